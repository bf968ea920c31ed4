"""Helpers shared by tests/gpu/check_kernels.py and benchmarks/kernels.py (plain scripts, no pytest).

``bootstrap()`` makes the repository importable from a bare checkout (no pip install): it puts the
repository root on sys.path, maps ``elastic_vllm.csrc`` to csrc/, and, when pydantic is absent
(the GPU image has only torch, triton, numpy), installs a minimal stand-in so that
``elastic_vllm.config`` (imported by the reference package for HeadMode) loads. Nothing here
validates configs; the scripts never build an ElasticConfig.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[2]


def _pydantic_stand_in() -> types.ModuleType:
    mod = types.ModuleType("pydantic")

    class BaseModel:
        model_fields: ClassVar[dict] = {}

        def __init__(self, **kw):
            for k, v in kw.items():
                setattr(self, k, v)

    class ValidationError(ValueError):
        pass

    mod.BaseModel = BaseModel
    mod.ValidationError = ValidationError
    mod.ConfigDict = dict
    mod.Field = lambda default=None, **kw: default
    mod.model_validator = lambda **kw: lambda f: f
    mod.field_validator = lambda *a, **kw: lambda f: f
    mod.__elastic_stand_in__ = True
    return mod


def bootstrap() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import pydantic  # noqa: F401
    except ImportError:
        sys.modules["pydantic"] = _pydantic_stand_in()
    from elastic_vllm.source_tree import use_source_kernels

    # the kernels timed are those of this tree: an editable install elsewhere (or of another checkout, as in
    # the A/B of tools/gpu_session.sh ab) would map elastic_vllm.csrc to its own csrc/
    use_source_kernels(ROOT)


def env_info() -> dict:
    import torch
    import triton

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    # the device machine gets a copy of the working tree without .git: the caller passes the commit
    in_git = (ROOT / ".git").exists()
    commit = os.environ.get("GIT_COMMIT") or (git("rev-parse", "HEAD") if in_git else "") or "unknown"
    return {
        "gpu": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "git_commit": commit,
        "git_commit_from": "GIT_COMMIT" if os.environ.get("GIT_COMMIT") else ("git" if in_git else "none"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if in_git else None,
        "python": sys.version.split()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "csrc_sha256": csrc_sha256(),
    }


def csrc_sha256() -> str:
    """One hash of the kernel sources this run imports (csrc/*.py of this tree, by name): says which kernels a
    result timed when the tree is not a git checkout (the device machine) or when two trees are compared."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((ROOT / "csrc").glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def close_llm(llm) -> None:
    """Shut a vLLM ``LLM`` down (its engine core and, with TP, its workers) and free what it held."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def write_json(path: str | os.PathLike | None, payload: dict) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(p)


def make_paged(keys, values, block_size: int, gen=None, spare: int = 2):
    """Scatter per-request [S_b, Hkv, D] keys/values into a randomly permuted paged cache.

    Returns key_cache, value_cache [num_blocks, block_size, Hkv, D] (views of one
    [num_blocks, 2, block_size, Hkv, D] tensor, like vLLM's) and block_table [B, max_blocks] int32.
    """
    import torch

    dev = keys[0].device
    hkv, d = keys[0].shape[1:]
    nblk = [math.ceil(k.shape[0] / block_size) for k in keys]
    total = sum(nblk) + spare + 1
    perm = torch.randperm(total - 1, generator=gen, device="cpu").to(dev) + 1  # block 0 reserved
    kv = torch.zeros(total, 2, block_size, hkv, d, device=dev, dtype=keys[0].dtype)
    bt = torch.zeros(len(keys), max(max(nblk), 1), device=dev, dtype=torch.int32)
    at = 0
    for b, (k, v, n) in enumerate(zip(keys, values, nblk)):
        ids = perm[at : at + n]
        at += n
        bt[b, :n] = ids.to(torch.int32)
        pos = torch.arange(k.shape[0], device=dev)
        kv[ids[pos // block_size], 0, pos % block_size] = k
        kv[ids[pos // block_size], 1, pos % block_size] = v
    return kv[:, 0], kv[:, 1], bt


def chunked_reference(
    q,
    key_cache,
    value_cache,
    block_table,
    query_start_loc,
    seq_lens,
    head_modes,
    sink,
    window,
    xa_block_masks=None,
    xa_block=128,
    chunk=2048,
    compute_dtype=None,
):
    """hybrid_attention_ref's semantics by query chunks (fits 32K+ on one GPU), float32 by default.

    ``compute_dtype=q.dtype`` gives "PyTorch in the kernel's dtype", the baseline of the
    flash-attention tolerance rule. Uses the reference's own ``visible`` mask and ``gather_paged``.
    """
    import torch

    from elastic_vllm.reference.attention import gather_paged, visible

    cd = torch.float32 if compute_dtype is None else compute_dtype
    _t, hq, d = q.shape
    hkv = key_cache.shape[2]
    g = hq // hkv
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        n = int(seq_lens[b])
        k = gather_paged(key_cache, block_table[b], n).to(cd)
        v = gather_paged(value_cache, block_table[b], n).to(cd)
        kpos = torch.arange(n, device=q.device)
        for h in range(hkv):
            mode = int(head_modes[b, h])
            bm = None if xa_block_masks is None or xa_block_masks[b] is None else xa_block_masks[b][h]
            for c0 in range(s, e, chunk):
                c1 = min(c0 + chunk, e)
                qpos = torch.arange(n - (e - c0), n - (e - c1), device=q.device)
                hi = int(qpos[-1]) + 1  # causal: no key past the chunk's last query
                mask = visible(mode, qpos, kpos[:hi], sink, window, bm, xa_block)
                qh = q[c0:c1, h * g : (h + 1) * g].to(cd)
                sc = torch.einsum("qgd,kd->gqk", qh, k[:hi, h]).float() * d**-0.5
                sc = sc.masked_fill(~mask, float("-inf"))
                o = torch.einsum("gqk,kd->qgd", torch.softmax(sc, -1).to(cd), v[:hi, h])
                out[c0:c1, h * g : (h + 1) * g] = o.to(q.dtype)
    return out


def bench(fn, est_ms: float | None = None, min_reps: int = 3) -> dict:
    """triton.testing.do_bench median and p20/p80 (ms): >= 100 ms of repetitions and at least
    ``min_reps`` calls (slow calls: the spread was < 1% on the H200), warm-up <= 0.5 s."""
    import torch
    from triton.testing import do_bench

    if est_ms is None:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t) * 1e3
    rep = min(max(100.0, min_reps * est_ms), 2500.0)
    warm = min(max(25.0, est_ms), 500.0)
    med, p20, p80 = do_bench(fn, warmup=warm, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"ms": med, "p20": p20, "p80": p80}


def ssa_visible_pairs(length: int, sink: int, window: int) -> int:
    """Causal (i, j) pairs with j < sink or i - j < window (same closed form as elastic_vllm.sparsity)."""
    w = min(length, window)
    in_window = w * (w + 1) // 2 + (length - w) * window
    m = max(0, length - window)
    s = min(sink, m)
    return in_window + s * (s + 1) // 2 + (m - s) * sink


def decode_visible_tokens(length: int, sink: int, window: int) -> int:
    """Keys an SSA head reads for the query at length-1: j < sink or j >= length - window."""
    return min(length, min(sink, length) + min(window, length) - max(0, min(sink, length) - max(length - window, 0)))
