"""What the kernel benchmarks share (``kernels_*.py``, one question each, and the tuning sweeps of
tools/tune_kernels.py): one run's settings and report, its inputs at the Llama-3.1-8B attention shape, the
correctness gate every timing waits for, and the command line.

Shape: 32 query / 8 KV heads, bf16, SSA sink 128 + window 2048; a paged cache with randomly permuted blocks
(block 0 unused). ``--cpu-dry`` runs the same plumbing at toy sizes under TRITON_INTERPRET=1 (float16: the
interpreter mishandles bf16; sink 16 + window 100 keep the SSA mask non-trivial at toy lengths).

A run holds its state in a ``KernelRun`` passed to every section; nothing here is module state.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable

import torch  # (does not import triton: TRITON_INTERPRET can still be set before the kernels load)
from _harness import ROOT, bench, environment, gate, log, quantiles, write_json

HQ, HKV = 32, 8
# vLLM's default KV block size; the elastic backend's own default on CUDA is 128 (``ElasticAttentionBackend
# .get_preferred_block_size``), which the prefill benchmarks time
BS = 16
CUDA_BLOCK_SIZE = 128


class KernelRun:
    """One benchmark run: device, dtype, SSA shape, what to run, and the report (written after every measurement,
    so a run cut short keeps what it measured)."""

    def __init__(self, out: str, cpu_dry: bool = False, quick: bool = False, sections: str = ""):
        self.out = out
        self.cpu_dry = cpu_dry
        self.quick = quick
        self.filters = [k for k in sections.split(",") if k]
        self.dev = torch.device("cpu" if cpu_dry else "cuda")
        self.dt = torch.float16 if cpu_dry else torch.bfloat16
        self.sink, self.window = (16, 100) if cpu_dry else (128, 2048)
        self.report: dict = {}

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"

    def size(self, gpu: int, dry: int) -> int:
        return dry if self.cpu_dry else gpu

    def save(self) -> None:
        write_json(self.out, self.report)

    def rows(self, key: str) -> list:
        return self.report.setdefault(key, [])

    def wanted(self, name: str) -> bool:
        return not self.filters or any(k in name for k in self.filters)

    def section(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` if ``--sections`` selects it; a failure is recorded and the next section runs."""
        if not self.wanted(name):
            return
        log(f"== {name}")
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            self.report.setdefault("errors", []).append({"section": name, "error": repr(e)[:1000]})
        finally:
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            self.save()

    # --- timing ---------------------------------------------------------------------------------------------
    def timeit(self, fn, **kw) -> dict:
        return bench(fn, cuda=self.cuda, **kw)

    def graph_time(self, fn, calls: int = 10) -> dict:
        """ms per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (what vLLM's decode step runs: no
        launch overhead), next to ``timeit`` (eager, one call per L2 flush)."""
        if not self.cuda:
            return self.timeit(fn)
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        r = self.timeit(g.replay)
        return {k: v / calls for k, v in r.items()}

    def timed_after(self, fn, pre, reps: int = 15) -> dict:
        """ms of ``fn`` alone (CUDA events around it) when each call follows ``pre`` on the stream."""
        if not self.cuda:
            pre()
            return self.timeit(fn)
        fn()
        torch.cuda.synchronize()
        ev = []
        for _ in range(reps):
            pre()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            ev.append((a, b))
        torch.cuda.synchronize()
        q = quantiles([a.elapsed_time(b) for a, b in ev])
        return {"ms": q["median"], "p20": q["p20"], "p80": q["p80"]}

    # --- inputs ---------------------------------------------------------------------------------------------
    def prefill_inputs(self, S: int, d: int, seed: int = 0) -> dict:
        """One S-token prompt: q [S, Hq, d]; the [1, H, S, d] copies SDPA / Flex take; caches built per block
        size by ``paged``."""
        g = torch.Generator(device=self.dev).manual_seed(seed)
        q = torch.randn(S, HQ, d, device=self.dev, dtype=self.dt, generator=g)
        k = torch.randn(S, HKV, d, device=self.dev, dtype=self.dt, generator=g)
        v = torch.randn(S, HKV, d, device=self.dev, dtype=self.dt, generator=g)
        return {
            "q": q,
            "qsl": torch.tensor([0, S], device=self.dev, dtype=torch.int32),
            "sl": torch.tensor([S], device=self.dev, dtype=torch.int32),
            "qT": q.transpose(0, 1).contiguous()[None],  # [1, Hq, S, d] for SDPA / Flex
            "kT": k.transpose(0, 1).contiguous()[None],
            "vT": v.transpose(0, 1).contiguous()[None],
            "seed": seed,
            "caches": {},
        }

    def paged(self, x: dict, bs: int) -> tuple:
        """(key_cache, value_cache, block_table) of x's keys in ``bs``-token blocks, built once per block size."""
        from elastic_vllm.reference.paged import make_paged

        if bs not in x["caches"]:
            k, v = x["kT"][0].transpose(0, 1), x["vT"][0].transpose(0, 1)
            x["caches"][bs] = make_paged([k], [v], bs, torch.Generator().manual_seed(x["seed"] + bs))
        return x["caches"][bs]

    def decode_inputs(self, ctx: int, B: int, d: int) -> tuple:
        """A paged [blocks, 2, BS, Hkv, d] cache of B requests of ctx tokens (randomly permuted blocks, block 0
        unused), their block table, queries, lengths and an output buffer."""
        nblk = B * math.ceil(ctx / BS)
        kv = torch.randn(nblk + 1, 2, BS, HKV, d, device=self.dev, dtype=self.dt)
        bt = (torch.randperm(nblk, device=self.dev) + 1).to(torch.int32).view(B, -1)
        q = torch.randn(B, HQ, d, device=self.dev, dtype=self.dt)
        sl = torch.full((B,), ctx, device=self.dev, dtype=torch.int32)
        return kv, bt, q, sl, torch.empty_like(q)

    def head_modes(self, share: float, rows: int = 1) -> torch.Tensor:
        """[rows, Hkv] int8: the first round(share x Hkv) KV heads SSA, the rest FA."""
        return torch.tensor([sa_heads(share)] * rows, device=self.dev, dtype=torch.int8)

    def prefill_flops(self, S: int, d: int, share: float) -> float:
        """FLOPs the mask requires (FA heads: causal pairs; SSA heads: sink + window pairs)."""
        from elastic_vllm.sparsity import ssa_visible_pairs

        n_sa = sum(sa_heads(share)) * (HQ // HKV)
        pairs = (HQ - n_sa) * S * (S + 1) // 2 + n_sa * ssa_visible_pairs(S, self.sink, self.window)
        return 4.0 * d * pairs

    def prefill_config(self, d: int) -> dict:
        """The cache block size and tiles the prefill rows time: the backend's block size (128 on CUDA) and the
        kernel's default tiles, or ``--prefill-config`` (e.g. a winner of tools/tune_kernels.py)."""
        return dict(self.report.get("prefill_config_by_head_dim", {}).get(str(d)) or {"bs": self.default_bs})

    @property
    def default_bs(self) -> int:
        return CUDA_BLOCK_SIZE if self.cuda else BS


def sa_heads(share: float) -> list[int]:
    """1 for the first round(share x Hkv) KV heads (SSA), 0 for the rest (FA)."""
    n = round(share * HKV)
    return [1 if h < n else 0 for h in range(HKV)]


def kernel_resources(jit_fn) -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of a Triton kernel (best effort: Triton's
    cache layout is not an API, so a layout it does not know is a row naming the error)."""
    rows = []
    try:
        for cache in jit_fn.device_caches.values():
            for k in cache[0].values():
                k = k.result() if hasattr(k, "result") else k
                md = k.metadata
                consts = getattr(k.src, "constants", {}) if hasattr(k, "src") else {}
                rows.append({
                    "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                    "shared": getattr(md, "shared", None), "num_warps": getattr(md, "num_warps", None),
                    "num_stages": getattr(md, "num_stages", None), "constants": {str(a): str(b) for a, b in consts.items()},
                })  # fmt: skip
    except Exception as e:
        rows.append({"error": repr(e)[:200]})
    return rows


# --- the gate: no kernel is timed unless prefill and decode match the fp32 reference ------------------------
def ceilings(run: KernelRun) -> None:
    """Copy bandwidth and a bf16 matmul: what the TB/s and TFLOP/s of the kernels are read against."""
    n = (1 << 30) if run.cuda else (1 << 20)
    src = torch.empty(n, device=run.dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = run.timeit(lambda: dst.copy_(src))
    mm = 8192 if run.cuda else 256
    a = torch.randn(mm, mm, device=run.dev, dtype=run.dt)
    b = torch.randn(mm, mm, device=run.dev, dtype=run.dt)
    tm = run.timeit(lambda: a @ b)
    run.report["ceilings"] = {
        "copy_TBps": 2 * 4 * n / (t["ms"] * 1e-3) / 1e12,
        "bf16_matmul_TFLOPs": 2 * mm**3 / (tm["ms"] * 1e-3) / 1e12,
    }
    log(f"ceilings {run.report['ceilings']}")


def correctness(run: KernelRun) -> None:
    """Prefill (block sizes 16 and 128, dense and 75% SSA) and ragged sparse decode against the fp32 reference,
    by the flash-attention rule (``_harness.gate``)."""
    from elastic_vllm.ops.decode.kernel import decode_attention
    from elastic_vllm.ops.prefill.kernel import prefill_attention
    from elastic_vllm.reference.attention import hybrid_attention_chunked, hybrid_attention_ref
    from elastic_vllm.reference.paged import make_paged

    res = run.rows("correctness")
    S = run.size(8192, 256)
    dev, dt, sink, window = run.dev, run.dt, run.sink, run.window
    x = run.prefill_inputs(S, 128, seed=1)
    for bs in (16, 128) if run.cuda else (16, 32):
        kc, vc, bt = run.paged(x, bs)
        for share in (0.0, 0.75):
            hm = run.head_modes(share)
            args = (x["q"], kc, vc, bt, x["qsl"], x["sl"], hm)
            out = prefill_attention(*args, sink=sink, window=window)
            ref = hybrid_attention_chunked(*args, sink, window)
            base = hybrid_attention_chunked(*args, sink, window, compute_dtype=dt)
            res.append({"what": f"prefill {S} d128 bs{bs} SA {share} (default config)", **gate(out, ref, base)})
            log(res[-1])
    del x
    B = 16  # decode: 16 requests of ragged length, sparse
    g = torch.Generator().manual_seed(2)
    lens = [int(n) for n in torch.randint(1, S, (B,), generator=g)]
    keys = [torch.randn(n, HKV, 128, generator=g).to(dev, dt) for n in lens]
    vals = [torch.randn(n, HKV, 128, generator=g).to(dev, dt) for n in lens]
    kc, vc, bt = make_paged(keys, vals, BS, g)
    q = torch.randn(B, HQ, 128, generator=g).to(dev, dt)
    sl = torch.tensor(lens, device=dev, dtype=torch.int32)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32)
    hm = torch.tensor([[1 if h % 4 else 0 for h in range(HKV)]] * B, device=dev, dtype=torch.int8)
    out = decode_attention(q, kc, vc, bt, sl, hm, sink=sink, window=window, max_seq_len=S)
    ref = hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, sink, window)
    base = hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, sink, window, compute_dtype=dt)
    res.append({"what": "decode B16 ragged sparse", **gate(out, ref, base)})
    log(res[-1])


# --- command line ---------------------------------------------------------------------------------------------
def parse_args(doc: str, argv: list[str] | None = None, extra: Callable | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<time>.json)")
    ap.add_argument("--quick", action="store_true", help="reduced grid: 32K/128K, SA 0/0.75, d 128")
    ap.add_argument("--sections", default="", help="comma-separated section name filters (default: every section)")
    ap.add_argument("--cpu-dry", action="store_true", help="toy sizes under TRITON_INTERPRET=1 (plumbing check)")
    ap.add_argument("--prefill-config", default="",
                    help="JSON {head_dim: {bs, block_n, num_warps, ...}} the prefill rows time instead of the backend's "
                         "block size with the kernel's default tiles (e.g. tools/tune_kernels.py's winners)")  # fmt: skip
    if extra is not None:
        extra(ap)
    return ap.parse_args(argv)


def start(args: argparse.Namespace) -> KernelRun | None:
    """The run of ``args``, its record written; None (after saying why) without a GPU and without --cpu-dry."""
    import json

    if args.cpu_dry:
        os.environ["TRITON_INTERPRET"] = "1"
    out = args.out or str(ROOT / "benchmarks" / "results" / f"kernels-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if not args.cpu_dry and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry for a plumbing check)")
        return None
    run = KernelRun(out, cpu_dry=args.cpu_dry, quick=args.quick, sections=args.sections)
    run.report.update({"env": environment(), "config": {
        "Hq": HQ, "Hkv": HKV, "sink": run.sink, "window": run.window, "block_size_default": BS,
        "dtype": str(run.dt), "quick": args.quick}})  # fmt: skip
    if args.prefill_config:
        run.report["prefill_config_by_head_dim"] = {str(k): v for k, v in json.loads(args.prefill_config).items()}
    log(run.report["env"])
    run.save()
    return run


def main(doc: str, questions: Iterable, argv: list[str] | None = None) -> int:
    """Run the gate (on a GPU always; under --cpu-dry when --sections names it), then every selected section of
    each question (a module with ``sections(run) -> [(name, fn)]`` and ``summary(run)``), then each question's
    summary: the device tool's reply carries the end of the output."""
    args = parse_args(doc, argv)
    run = start(args)
    if run is None:
        return 2
    run.section("ceilings", lambda: ceilings(run))
    if run.cuda or run.wanted("correctness"):
        filters, run.filters = run.filters, []  # the gate is not filtered away on a GPU
        run.section("correctness", lambda: correctness(run))
        run.filters = filters
    bad = [c for c in run.report.get("correctness", []) if not c["ok"]] or run.report.get("errors")
    if bad:
        log(f"correctness gate failed, nothing timed: {bad}")
        return 1
    questions = list(questions)
    for q in questions:
        for name, fn in q.sections(run):
            run.section(name, fn)
    run.save()
    for q in questions:
        q.summary(run)
    log(f"done: {len(run.report.get('errors', []))} section errors -> {run.out}")
    return 0


if __name__ == "__main__":
    sys.exit("a module of the kernel benchmarks: run benchmarks/kernels.py or one benchmarks/kernels_*.py")
