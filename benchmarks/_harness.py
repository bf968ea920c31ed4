"""What every benchmark here shares: the run's record (machine, versions,
commit, command), timing, the correctness gate, JSON written atomically, and running from a bare checkout (the
repository root first on sys.path: this tree's package, kernels included, is the one measured).

A benchmark script imports it as ``_harness`` (the script's folder is first on sys.path). Nothing here decides
which measurements run: a script runs the jobs it is asked for.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a bare checkout (the GPU machine's): this tree's package is the one measured
    sys.path.insert(0, str(ROOT))
T0 = time.time()

from elastic_vllm.provenance import kernel_sources_sha256, provenance, versions, write_json  # noqa: E402, F401  (re-exported)


def log(msg: object) -> None:
    """A progress line with the seconds since the script started."""
    print(f"[{time.time() - T0:6.0f}s] {msg}", flush=True)


# --- the run's record (elastic_vllm.provenance, shared with the evaluation and the GPU checks) ---------------
def environment(modules: tuple[str, ...] = ("torch", "triton"), argv: list[str] | None = None) -> dict:
    """Everything a result file records about its run: provenance, versions and which kernel sources ran (this
    tree's elastic_vllm/ops, the package ``_harness`` puts first on sys.path)."""
    return {**provenance(argv), **versions(modules), "ops_sha256": kernel_sources_sha256(ROOT / "elastic_vllm" / "ops")}


# --- timing --------------------------------------------------------------------------------------------------
def made_with(env: dict, merged: list[dict] = (), extra: str = "") -> str:
    """A result's provenance sentence for its markdown: versions, commit, the command (and those merged in)."""
    return (
        f"vLLM {env.get('vllm')}, torch {env.get('torch')}"
        + (f", triton {env['triton']}" if env.get("triton") else "")
        + f", commit {env['git_commit']}{' (uncommitted changes)' if env.get('git_dirty') else ''}. "
        + f"Command: `{env['command']}`{extra}"
        + "".join(f"; merged: `{m['command']}` ({m['git_commit']})" for m in merged)
        + "."
    )


def quantiles(samples: list[float]) -> dict:
    """Median with p20 / p80 of repeated measurements (any unit)."""
    s = sorted(samples)
    if not s:
        raise ValueError("quantiles of no samples")
    mid = len(s) // 2
    med = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    return {"median": med, "p20": s[len(s) // 5], "p80": s[min(len(s) - 1, (4 * len(s)) // 5)], "min": s[0]}


def bench(fn, est_ms: float | None = None, min_reps: int = 3, cuda: bool | None = None) -> dict:
    """ms of ``fn`` on the GPU: triton.testing.do_bench median and p20/p80, >= 100 ms of repetitions and at least
    ``min_reps`` calls (slow calls: the spread was < 1% on the H200), warm-up <= 0.5 s. Off the GPU (``cuda``
    False, default: whether CUDA is available) one timed call: plumbing runs under the Triton interpreter, where
    the number means nothing."""
    import torch

    if not (torch.cuda.is_available() if cuda is None else cuda):
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return {"ms": ms, "p20": ms, "p80": ms}
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


# --- correctness gate ----------------------------------------------------------------------------------------
def gate(out, ref, base, floor: float = 1e-3) -> dict:
    """The flash-attention rule: the kernel's max error against the fp32 reference ``ref`` at most twice that of
    PyTorch in the kernel's dtype (``base``) plus ``floor``. NaN anywhere fails."""
    err = float((out.float() - ref.float()).abs().max())
    bound = 2 * float((base.float() - ref.float()).abs().max()) + floor
    return {"err": err, "bound": bound, "ok": err <= bound}
