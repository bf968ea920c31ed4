#!/usr/bin/env python3
"""How much does a sparse decode step save, and how close is dense decode to the copy bandwidth?

    GIT_COMMIT=<sha> python3 benchmarks/kernels_decode.py [--out PATH] [--sections NAME,...]

The decode kernel at 32K and 128K contexts, batch 1/16/64, every head FA (dense) vs 75% of the KV heads SSA
(sparse), at its default split count and tiles; TB/s counts only the K/V bytes the mask requires, next to the
copy bandwidth measured in the same run (``ceilings``). The split-count and tile sweeps are tools/tune_kernels.py.
The correctness gate runs first (benchmarks/_kernel_bench.py). ``--cpu-dry``: toy sizes under the interpreter.
"""

from __future__ import annotations

import functools
import sys

from _harness import log
from _kernel_bench import HKV, KernelRun, main, sa_heads


def decode_visible(run: KernelRun, ctx: int) -> int:
    from elastic_vllm.sparsity import decode_visible_tokens

    return decode_visible_tokens(ctx, run.sink, run.window)


def decode_batch(run: KernelRun, ctx: int, B: int) -> None:
    from elastic_vllm.ops.decode.kernel import decode_attention

    rows = run.rows("decode")
    d = 128
    kv, bt, q, sl, out = run.decode_inputs(ctx, B, d)
    res = {}
    for mode, share in (("dense", 0.0), ("sparse", 0.75)):
        hm = run.head_modes(share, rows=B)
        n_sa = sum(sa_heads(share))
        toks = (HKV - n_sa) * ctx + n_sa * decode_visible(run, ctx)
        nbytes = B * toks * d * 2 * kv.element_size()
        fn = functools.partial(decode_attention, q, kv[:, 0], kv[:, 1], bt, sl, hm, sink=run.sink,
                               window=run.window, max_seq_len=ctx, out=out)  # fmt: skip
        r = run.timeit(fn)
        res[mode] = r
        row = {"ctx": ctx, "B": B, "mode": mode, **r, "TBps": nbytes / (r["ms"] * 1e-3) / 1e12}
        if mode == "sparse":
            row["x_vs_dense"] = res["dense"]["ms"] / r["ms"]
        if "ceilings" in run.report:
            row["frac_of_copy_bw"] = row["TBps"] / run.report["ceilings"]["copy_TBps"]
        rows.append(row)
        log(row)
    run.save()


def sections(run: KernelRun) -> list:
    if run.cpu_dry:
        return [("decode 512", lambda: decode_batch(run, 512, 2))]
    return [(f"decode {ctx // 1024}K", lambda ctx=ctx: [decode_batch(run, ctx, B) for B in (1, 16, 64)])
            for ctx in (32768, 131072)]  # fmt: skip


def summary(run: KernelRun) -> None:
    for r in run.report.get("decode", []):
        print(f"  decode ctx={r['ctx']} B={r['B']} {r['mode']:<6} {r['ms']:.3f} ms {r['TBps']:.2f} TB/s"
              f" {r.get('x_vs_dense', '')}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(__doc__, [sys.modules[__name__]]))
