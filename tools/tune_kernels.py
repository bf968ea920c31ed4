#!/usr/bin/env python3
"""The sweeps that chose the kernels' default tiles and split counts: candidate configs timed side by side, each
checked against the first (itself the default, checked against the fp32 reference by the gate).

    GIT_COMMIT=<sha> python3 tools/tune_kernels.py [--out PATH] [--sections tune,decode splits,decode config]

  tune d128 / tune d64  prefill configs (cache block size, key tile, warps, stages) at 32K, SA 0 and 0.75; the
                        fastest correct one by the geometric mean of the two times is printed as --prefill-config
                        JSON for the prefill benchmarks
  decode splits         the decode kernel's split count around its default at the e2e decode shapes
  decode config         decode tiles (block_n, stages, warps), replayed from a CUDA graph as vLLM's decode runs it
Runs on the benchmarks' harness (benchmarks/_kernel_bench.py, found beside this checkout's benchmarks/).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:  # the harness's modules are scripts of benchmarks/, not a package
    sys.path.insert(0, str(BENCH))

import torch  # noqa: E402
from _harness import log  # noqa: E402
from _kernel_bench import HKV, KernelRun, kernel_resources, main  # noqa: E402
from kernels_prefill import ours  # noqa: E402

# tried at 32K (d 128) in this order; the first is the default path. 128-token blocks are a legitimate cache
# layout for this backend (vLLM lets a backend declare its kernel block sizes); a key tile then lies inside one
# block (one block-table read).
TUNE_CANDIDATES = [
    {"bs": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"bs": 16, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"bs": 16, "block_n": 64, "num_warps": 8, "num_stages": 3},
    # two programs per SM (sm_90 build, results/experiments/sm90-build.json: 249 registers at 4 warps, no stack, 112 KB of
    # shared memory, against 255 / 224 KB for the 128 x 128 default): one program's softmax can run under the other's MMAs without warp
    # specialization, at twice the K/V reads from L2 per FLOP (measured slower: 22.10 vs 16.56 ms dense at 32K,
    # kernels-prefill-fa3-h200.json)
    {"bs": 128, "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
]

# head_dim 64 (SmolLM2, Qwen2.5-0.5B...): smaller tiles per FLOP, so fewer warps / more keys per tile may win;
# FlexAttention beat the d-128 winner here (0.86-0.93x in the first runs)
TUNE_CANDIDATES_D64 = [
    {"bs": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"bs": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"bs": 128, "block_n": 128, "num_warps": 4, "num_stages": 3},
    {"bs": 128, "block_n": 128, "num_warps": 4, "num_stages": 4},
    {"bs": 128, "block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
]


def tune_section(run: KernelRun, d: int) -> None:
    from elastic_vllm.ops.prefill.kernel import _prefill_kernel

    rows = run.rows("tune")
    S = run.size(32768, 256)
    x = run.prefill_inputs(S, d, seed=3)
    if run.cuda:
        cands = TUNE_CANDIDATES if d == 128 else TUNE_CANDIDATES_D64
    else:
        cands = [{"bs": 16, "block_n": 32}, {"bs": 32, "block_n": 32}]
    base_out, scores = {}, []
    for i, cfg in enumerate(cands):
        row = {"S": S, "d": d, **cfg}
        try:
            t0 = time.perf_counter()
            for share in (0.0, 0.75):
                fn = ours(run, x, share, cfg)
                out = fn()  # compiles
                if run.cuda:
                    torch.cuda.synchronize()
                if share not in base_out:  # the first candidate that ran is the reference of the others
                    base_out[share] = out.clone()
                rel = float((out.float() - base_out[share].float()).norm() / base_out[share].float().norm())
                row[f"rel_diff_vs_first_{share}"] = rel
                if not rel < 1e-2:  # NaN fails too
                    raise RuntimeError(f"output differs from the first candidate's (relative {rel:.3g})")
                r = run.timeit(fn)
                row[f"ms_{share}"] = r["ms"]
                row[f"TFLOPs_{share}"] = run.prefill_flops(S, d, share) / (r["ms"] * 1e-3) / 1e12
            row["s"] = round(time.perf_counter() - t0, 1)
            scores.append((math.sqrt(row["ms_0.0"] * row["ms_0.75"]), i))
        except Exception as e:  # e.g. out of shared memory for this config on this Triton
            traceback.print_exc()
            row["error"] = repr(e)[:300]
        rows.append(row)
        log(row)
        run.save()
    if scores:
        run.report.setdefault("best_prefill_config", {})[str(d)] = dict(cands[min(scores)[1]])
    run.report["prefill_kernel_variants"] = kernel_resources(_prefill_kernel)
    del x, base_out


def decode_sweep(run: KernelRun, key: str, shapes, variants, timing: str) -> None:
    """Rows ``report[key]``: for each (ctx, B) of ``shapes`` and each of dense / 75% SSA heads, the decode kernel
    with each kwargs dict of ``variants(ctx, B)`` (the first is the reference of ``rel_diff_vs_first``), timed
    eagerly (``timing`` "eager": ms at the row's top level) or from a CUDA graph ("graph")."""
    from elastic_vllm.ops.decode.kernel import decode_attention

    rows = run.rows(key)
    for ctx, B in shapes:
        kv, bt, q, sl, out = run.decode_inputs(ctx, B, 128)
        for mode, share in (("dense", 0.0), ("sparse", 0.75)):
            hm = run.head_modes(share, rows=B)
            first = None
            for kw in variants(ctx, B):
                fn = functools.partial(decode_attention, q, kv[:, 0], kv[:, 1], bt, sl, hm, sink=run.sink,
                                       window=run.window, max_seq_len=ctx, out=out, **kw)  # fmt: skip
                o = fn().float()
                first = o.clone() if first is None else first
                row = {
                    "ctx": ctx,
                    "B": B,
                    "mode": mode,
                    **kw,
                    "rel_diff_vs_first": float((o - first).norm() / first.norm()),
                }
                row.update(run.timeit(fn) if timing == "eager" else {"graph": run.graph_time(fn)})
                rows.append(row)
                log(row)
        del kv
        run.save()


def decode_splits_section(run: KernelRun) -> None:
    """Split count of the e2e decode shapes (32K x 16, 128K x 4): the default aims at ~32 programs per SM over all
    (request, KV head) pairs; with 75% SSA heads the work sits in the FA heads' 25% of the programs, and more
    splits spread it (SSA heads use only the splits their few tiles need)."""
    from elastic_vllm.ops.decode.kernel import decode_num_splits, default_decode_config

    def default(ctx, B):
        return decode_num_splits(B, HKV, ctx, default_decode_config(128)["block_n"], run.dev)

    shapes = ((32768, 16), (131072, 4)) if run.cuda else ((512, 2),)
    decode_sweep(run, "decode_splits", shapes,
                 lambda ctx, B: [{"num_splits": max(1, round(default(ctx, B) * m))} for m in (0.25, 0.5, 1, 2)],
                 "eager")  # fmt: skip


def decode_config_section(run: KernelRun) -> None:
    """Tile configs of the decode kernel at the e2e decode shapes; the first row of each shape is the default."""
    from elastic_vllm.ops.decode.kernel import default_decode_config

    dflt = default_decode_config(128)
    cfgs = [(dflt["block_n"], dflt["num_stages"], dflt["num_warps"])]
    cfgs += [c for c in ((64, 2, 4), (128, 2, 4), (64, 3, 4), (64, 1, 4), (128, 1, 4), (32, 2, 4), (32, 3, 4),
                         (128, 2, 8)) if c != cfgs[0]]  # fmt: skip
    cfgs = cfgs if run.cuda else cfgs[:2]
    shapes = ((32768, 16), (131072, 4), (131072, 16), (32768, 64)) if run.cuda else ((512, 2),)
    decode_sweep(run, "decode_config", shapes,
                 lambda ctx, B: [{"block_n": bn, "num_stages": st, "num_warps": nw} for bn, st, nw in cfgs],
                 "graph")  # fmt: skip


def sections(run: KernelRun) -> list:
    return [
        ("tune d128", lambda: tune_section(run, 128)),
        ("tune d64", lambda: tune_section(run, 64)),
        ("decode splits", lambda: decode_splits_section(run)),
        ("decode config", lambda: decode_config_section(run)),
    ]


def summary(run: KernelRun) -> None:
    for r in run.report.get("tune", []):
        print(f"  tune {r}")
    for r in run.report.get("decode_splits", []):
        print(f"  decode splits ctx={r['ctx']} B={r['B']} {r['mode']:<6} ns={r['num_splits']:<4} {r['ms']:.3f} ms")
    for r in run.report.get("decode_config", []):
        print(f"  decode config ctx={r['ctx']} B={r['B']} {r['mode']:<6} bn={r['block_n']:<4} stages={r['num_stages']}"
              f" warps={r['num_warps']} graph {r['graph']['ms']:.4f} ms rel {r['rel_diff_vs_first']:.1e}")  # fmt: skip
    if "best_prefill_config" in run.report:
        print(f"  --prefill-config '{json.dumps(run.report['best_prefill_config'])}'")


if __name__ == "__main__":
    sys.exit(main(__doc__, [sys.modules[__name__]]))
