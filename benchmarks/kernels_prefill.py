#!/usr/bin/env python3
"""How fast is the hybrid prefill kernel against SDPA, FlexAttention, the split and vLLM's FA3?

    GIT_COMMIT=<sha> python3 benchmarks/kernels_prefill.py [--out PATH] [--quick] [--sections NAME,...]

One prompt (batch 1, causal) at 8K/32K/128K/256K, head_dim 128 and 64, SA share = share of KV heads in SSA:
  ours    the prefill kernel over a paged cache (randomly permuted blocks) at the backend's block size (128 on
          CUDA) with the kernel's default tiles, or ``--prefill-config``; at 128K also at vLLM's default block 16
  sdpa / flex / split / fa3: the anchors of benchmarks/_anchors.py
Rows: median ms with p20/p80, TFLOP/s counting only the pairs the mask requires, ours' ratio to each anchor.
The correctness gate runs first (benchmarks/_kernel_bench.py). ``--cpu-dry``: toy sizes under the interpreter.
"""

from __future__ import annotations

import sys
import traceback

import torch
from _anchors import Anchors
from _harness import log
from _kernel_bench import KernelRun, kernel_resources, main


def ours(run: KernelRun, x: dict, share: float, cfg: dict):
    from elastic_vllm.ops.prefill.kernel import prefill_attention

    cfg = dict(cfg)
    kc, vc, bt = run.paged(x, cfg.pop("bs"))
    hm = run.head_modes(share)
    out = torch.empty_like(x["q"])
    return lambda: prefill_attention(
        x["q"], kc, vc, bt, x["qsl"], x["sl"], hm, sink=run.sink, window=run.window, out=out, **cfg
    )


def fa3_row(run: KernelRun, anchors: Anchors, x: dict, d: int, sdpa) -> dict:
    """vLLM's FA3 dense over the same paged cache (checked against SDPA first); a row saying why when absent."""
    S = x["q"].shape[0]
    bs = run.prefill_config(d)["bs"]
    try:
        fa3 = anchors.fa3(x, bs)
        a, b = fa3().float(), sdpa()[0].transpose(0, 1).float()
        diff = float((a - b).norm() / b.norm())
        del a, b
        t = run.timeit(fa3)
        return {"S": S, "d": d, "method": "vllm_fa3_dense", "how": "vllm.vllm_flash_attn fa_version=3, paged",
                "block_size": bs, "rel_diff_vs_sdpa": diff, **t,
                "TFLOPs": run.prefill_flops(S, d, 0.0) / (t["ms"] * 1e-3) / 1e12}  # fmt: skip
    except Exception as e:
        return {"S": S, "d": d, "method": "vllm_fa3_dense", "error": repr(e)[:300]}


def prefill_section(run: KernelRun, anchors: Anchors, S: int, d: int, shares, extra: dict | None = None) -> None:
    """SDPA dense and FA3 dense, then per share: ours, Flex one-call hybrid, split; ``extra`` maps more variants of
    ours to (config, shares to time it at), e.g. the block-16 cache when ours uses 128."""
    x = run.prefill_inputs(S, d)
    rows = run.rows("prefill")
    cfg = run.prefill_config(d)
    sdpa, how = anchors.sdpa(x)
    t_sdpa = run.timeit(sdpa)
    rows.append({"S": S, "d": d, "method": "sdpa_flash_dense", "how": how, **t_sdpa,
                 "TFLOPs": run.prefill_flops(S, d, 0.0) / (t_sdpa["ms"] * 1e-3) / 1e12})  # fmt: skip
    log(rows[-1])
    rows.append(fa3_row(run, anchors, x, d, sdpa))
    t_fa3 = rows[-1] if "ms" in rows[-1] else None
    log(rows[-1])
    run.save()
    for share in shares:
        flops = run.prefill_flops(S, d, share)
        fns = {"ours": ours(run, x, share, cfg), "flex_hybrid": anchors.flex_hybrid(x, share)}
        if 0.0 < share < 1.0:
            fns["split"] = anchors.split(x, share, sdpa)
        for name, (c, only) in (extra or {}).items():
            if share in only:
                fns[name] = ours(run, x, share, c)
        res = {}
        for name, fn in fns.items():
            try:
                res[name] = run.timeit(fn)
            except Exception as e:
                traceback.print_exc()
                res[name] = {"error": repr(e)[:300]}
        try:  # the anchor computes the same function: relative difference of the outputs
            a, b = fns["ours"]().float(), fns["flex_hybrid"]()[0].transpose(0, 1).float()
            res["flex_hybrid"]["rel_diff_vs_ours"] = float((a - b).norm() / a.norm())
            del a, b
        except Exception as e:
            res["flex_hybrid"]["rel_diff_vs_ours"] = repr(e)[:200]
        ours_ms = res["ours"].get("ms")
        for name, r in res.items():
            row = {"S": S, "d": d, "share": share, "method": name, **r}
            if name == "ours":
                row["config"] = cfg
            elif name in (extra or {}):
                row["config"] = extra[name][0]
            if "ms" in r:
                row["TFLOPs"] = flops / (r["ms"] * 1e-3) / 1e12
                if name == "ours":
                    row["x_vs_sdpa"] = t_sdpa["ms"] / r["ms"]
                    if t_fa3:  # dense FA3's time over ours (at share > 0: the hybrid against FA3's dense)
                        row["x_vs_fa3_dense"] = t_fa3["ms"] / r["ms"]
                    for other in ("flex_hybrid", "split"):
                        if "ms" in res.get(other, {}):
                            row[f"x_vs_{other}"] = res[other]["ms"] / r["ms"]
                elif ours_ms:
                    row["ours_speedup"] = r["ms"] / ours_ms
            rows.append(row)
            log(row)
        run.save()
    del x


def sections(run: KernelRun) -> list:
    from elastic_vllm.ops.prefill.kernel import _prefill_kernel

    anchors = Anchors(run)
    shares = (0.0, 0.75) if run.quick else (0.0, 0.5, 0.75, 1.0)

    def at(S, d, sh=shares, extra=None):
        return f"prefill S={S} d={d}", lambda: prefill_section(run, anchors, S, d, sh, extra)

    def resources():
        run.report["prefill_config"] = {str(d): run.prefill_config(d) for d in (128, 64)}
        run.report["prefill_kernel_variants"] = kernel_resources(_prefill_kernel)

    if run.cpu_dry:
        return [at(256, 128), ("prefill kernel variants", resources)]
    bs16 = {} if run.prefill_config(128)["bs"] == 16 else {"ours_bs16_default": ({"bs": 16}, (0.75,))}
    out = [at(32768, 128), at(131072, 128, extra=bs16)]
    if not run.quick:
        out += [at(8192, 128), at(32768, 64), at(131072, 64, (0.0, 0.75)), at(262144, 128, (0.0, 0.75))]
    return [*out, ("prefill kernel variants", resources)]


def summary(run: KernelRun) -> None:
    rows = run.report.get("prefill", [])
    if rows:
        print("\nprefill (ms / TFLOP/s; x = ours speedup)")
    for r in rows:
        if r.get("method") == "ours" and "ms" in r:
            print(f"  S={r['S']:>6} d={r['d']} SA {r['share']:<4} ours {r['ms']:8.2f} ms {r['TFLOPs']:6.0f} TF/s"
                  f"  x_sdpa {r.get('x_vs_sdpa', 0):5.2f}  x_flex {r.get('x_vs_flex_hybrid', 0):5.2f}"
                  f"  x_split {r.get('x_vs_split', 0):5.2f}  x_fa3_dense {r.get('x_vs_fa3_dense', 0):5.2f}")  # fmt: skip
        elif r.get("method") == "vllm_fa3_dense":
            what = f"{r['ms']:8.2f} ms {r['TFLOPs']:6.0f} TF/s" if "ms" in r else r.get("error")
            print(f"  S={r['S']:>6} d={r['d']} vLLM FA3 dense {what}")


if __name__ == "__main__":
    sys.exit(main(__doc__, [sys.modules[__name__]]))
