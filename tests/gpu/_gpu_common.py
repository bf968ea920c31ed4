"""Helpers of the GPU checks (tests/gpu/check_*.py) and benchmarks/kernels.py (plain scripts, no pytest): paged
caches, the chunked fp32 reference, closed forms of the SSA mask's work, closing a vLLM engine. The run's record,
timing, JSON and the bare-checkout bootstrap (repository on sys.path, ``elastic_vllm.csrc`` -> csrc/, a pydantic
stand-in on the GPU image) come from benchmarks/_harness.py, re-exported here for the checks.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _harness import ROOT, bench, bootstrap, environment, write_json  # noqa: F401  (re-exported)


def close_llm(llm) -> None:
    """Shut a vLLM ``LLM`` down (its engine core and, with TP, its workers) and free what it held."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


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
