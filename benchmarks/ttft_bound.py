#!/usr/bin/env python3
"""What a TTFT target asks of the attention kernel, from the profiled rows of an e2e result file.

    python3 benchmarks/ttft_bound.py benchmarks/results/e2e-vllm-h200-llama.json \
        --out benchmarks/results/ttft-bound-h200-llama.json

For each prompt length with a profiled FLASH_ATTN row and a profiled elastic row, the profile splits the
elastic prefill into attention (the elastic kernels: ``_prefill_kernel``, ``_route_*``, ``_xattn_*``), everything
else on the GPU (linear layers, norms, RoPE, cache writes) and host-only time (wall - GPU busy). A TTFT
speedup X over FLASH_ATTN leaves ``ttft_flash / X - other - host`` seconds for attention; dividing the
attention FLOPs the mask requires (causal; SA heads sink + window) by that gives the attention rate the
target needs, next to the rate FA3 itself reached on the dense FLOPs inside the same engine (its kernel
time in the FLASH_ATTN profile) and the rate the elastic kernel reached. No GPU needed: it reads JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _harness import provenance, write_json

from elastic_vllm.sparsity import causal_pairs, ssa_visible_pairs

ELASTIC_KERNELS = ("_prefill_kernel", "_route_", "_xattn")
FA3_KERNEL = "FlashAttnFwd"


def attention_flops(length: int, share: float, sink: int, window: int, hq: int, d: int, layers: int) -> float:
    """4 d FLOPs per visible (query, key) pair: causal for FA heads, sink + window for SA heads."""
    n_sa = round(share * hq)
    pairs = (hq - n_sa) * causal_pairs(length) + n_sa * ssa_visible_pairs(length, sink, window)
    return 4.0 * d * pairs * layers


def kernel_s(profile: dict, names: tuple[str, ...]) -> float:
    return sum(k["ms"] for k in profile["top_kernels"] if any(n in k["name"] for n in names)) / 1e3


def bounds(report: dict, targets: dict[int, float], hq: int, d: int, layers: int) -> list[dict]:
    el = report["engine"]["elastic"]
    sink, window = el["sink"], el["window"]
    rows = [r for r in report["ttft"] if r.get("profile")]
    out = []
    for flash in (r for r in rows if r["backend"] == "FLASH_ATTN"):
        n = flash["len"]
        ttft_flash = next(r["median_s"] for r in report["ttft"] if r["variant"] == "FLASH_ATTN" and r["len"] == n)
        fa3_s = kernel_s(flash["profile"], (FA3_KERNEL,))
        for e in (r for r in rows if r["backend"] == "elastic" and r["len"] == n):
            p = e["profile"]
            attn_s = kernel_s(p, ELASTIC_KERNELS)
            other_s = p["gpu_busy_s"] - attn_s
            host_s = max(0.0, p["wall_s"] - p["gpu_busy_s"])
            flops = attention_flops(n, e["share"], sink, window, hq, d, layers)
            dense = attention_flops(n, 0.0, sink, window, hq, d, layers)
            x = targets.get(n)
            row = {
                "len": n, "variant": e["variant"], "share": e["share"], "ttft_flash_s": ttft_flash,
                "elastic_profiled_wall_s": p["wall_s"], "elastic_attention_s": attn_s, "elastic_other_gpu_s": other_s,
                "elastic_host_only_s": host_s, "attention_tflop": flops / 1e12,
                "elastic_attention_TFLOPs": flops / attn_s / 1e12, "fa3_attention_s": fa3_s,
                "fa3_dense_TFLOPs_in_vllm": dense / fa3_s / 1e12 if fa3_s else None,
                "ttft_if_attention_free_s": other_s + host_s,
                "max_speedup_attention_free": ttft_flash / (other_s + host_s),
                "ttft_at_fa3_rate_s": other_s + host_s + flops / (dense / fa3_s) if fa3_s else None,
            }  # fmt: skip
            if row["ttft_at_fa3_rate_s"]:
                row["speedup_at_fa3_rate"] = ttft_flash / row["ttft_at_fa3_rate_s"]
            if x:
                budget = ttft_flash / x - other_s - host_s
                row.update({"target_speedup": x, "attention_budget_s": budget,
                            "needed_TFLOPs": flops / budget / 1e12 if budget > 0 else None})  # fmt: skip
                if budget > 0 and fa3_s:
                    row["needed_vs_fa3_rate"] = row["needed_TFLOPs"] / row["fa3_dense_TFLOPs_in_vllm"]
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("e2e_json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hq", type=int, default=32, help="query heads (Llama-3.1-8B: 32)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    report = json.loads(Path(args.e2e_json).read_text())
    targets = {8192: 1 / 1.05, 32768: 1.4, 131072: 1.6}  # 8K not >5% slower, 32K 1.4x, 128K 1.6x
    rows = bounds(report, targets, args.hq, args.head_dim, args.layers)
    if not rows:
        print("no profiled FLASH_ATTN + elastic pair in", args.e2e_json)
        return 1
    res = {"what": "TTFT target -> attention rate it needs (benchmarks/ttft_bound.py)", "source": args.e2e_json,
           "source_git_commit": report.get("git_commit"), "gpu": report.get("env", {}).get("gpu"),
           **provenance(), "rows": rows}  # fmt: skip
    for r in rows:
        print(f"{r['len']:>6} {r['variant']}: attention {r['elastic_attention_s']:.3f} s at "
              f"{r['elastic_attention_TFLOPs']:.0f} TFLOP/s, rest {r['elastic_other_gpu_s']:.3f} + host "
              f"{r['elastic_host_only_s']:.3f} s; FA3 dense in vLLM {r['fa3_dense_TFLOPs_in_vllm']:.0f} TFLOP/s; "
              f"at FA3's rate {r['speedup_at_fa3_rate']:.2f}x; target {r.get('target_speedup', 0):.2f}x needs "
              f"{r.get('needed_TFLOPs') or float('nan'):.0f} TFLOP/s")  # fmt: skip
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
