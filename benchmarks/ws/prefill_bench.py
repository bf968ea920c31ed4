#!/usr/bin/env python3
"""csrc/prefill_ws.py's warp-specialized kernel against the pointer kernel on the GPU: correctness, then time.

    GIT_COMMIT=<sha> python3 benchmarks/ws/prefill_bench.py --out benchmarks/results/dev/ws-prefill-bench-h200.json

Llama-3.1-8B attention (32 q / 8 KV heads, d 128, bf16), one request, block size 128 (the WS kernel needs key
tiles inside a block), SSA sink 128 + window 2048, SA share 0 and 0.75. The WS kernel is launched through
``prefill._launch_ws`` (the launcher's ``use_ws`` refuses the GPU while WS_GPU_BLOCKED stands); the pointer kernel
in the tuned block-128 config of benchmarks/results/kernels-h200.json (128 x 128 tiles, 8 warps, 3 stages,
pointer loads). Correctness: at 8K both against the float32 reference (flash-attention rule: at most twice the
bf16 reference's error, + 1e-3); at every length the WS output against the pointer kernel's (max abs diff).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from _gpu_common import (  # noqa: E402
    bench,
    bootstrap,
    chunked_reference,
    env_info,
    make_paged,
    ssa_visible_pairs,
    write_json,
)

HQ, HKV, D, BS, SINK, WINDOW = 32, 8, 128, 128, 128, 2048
POINTER_CFG = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "use_tma": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8192,32768,131072")
    args = ap.parse_args()
    bootstrap()
    import torch
    from elastic_vllm.csrc import prefill as P

    dev = torch.device("cuda")
    report = {"what": "prefill_ws vs the pointer kernel (benchmarks/ws/prefill_bench.py)", "env": env_info(),
              "config": {"Hq": HQ, "Hkv": HKV, "d": D, "block_size": BS, "sink": SINK, "window": WINDOW,
                         "pointer": POINTER_CFG, "ws": P.WS_TILES}, "rows": []}  # fmt: skip
    t0 = time.perf_counter()
    for S in (int(s) for s in args.lengths.split(",")):
        g = torch.Generator().manual_seed(S)
        keys = [torch.randn(S, HKV, D, generator=g).to(dev, torch.bfloat16)]
        vals = [torch.randn(S, HKV, D, generator=g).to(dev, torch.bfloat16)]
        kc, vc, bt = make_paged(keys, vals, BS, g)
        del keys, vals
        q = torch.randn(S, HQ, D, generator=g).to(dev, torch.bfloat16)
        qsl = torch.tensor([0, S], device=dev, dtype=torch.int32)
        sl = torch.tensor([S], device=dev, dtype=torch.int32)
        for share in (0.0, 0.75):
            n_sa = round(share * HKV)
            hm = torch.tensor([[1 if h < n_sa else 0 for h in range(HKV)]], device=dev, dtype=torch.int8)
            pairs = (HKV - n_sa) * S * (S + 1) // 2 + n_sa * ssa_visible_pairs(S, SINK, WINDOW)
            flops = 4.0 * D * (HQ // HKV) * pairs
            out_ws = torch.full_like(q, float("nan"))

            x = (q, kc, vc, bt, qsl, sl, hm)

            def ws(x=x, out_ws=out_ws):
                q, kc, vc, bt, qsl, sl, hm = x
                return P._launch_ws(q, kc, vc, out_ws, bt, qsl, sl, hm, None, SINK, WINDOW, D**-0.5, 128, 128,
                                    P.WS_TILES["num_warps"], P.WS_TILES["num_stages"], "long_first")  # fmt: skip

            def ptr(x=x):
                q, kc, vc, bt, qsl, sl, hm = x
                return P.prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=SINK, window=WINDOW, **POINTER_CFG)

            row = {"S": S, "share": share}
            try:
                o_ws, o_ptr = ws().clone(), ptr().clone()
                torch.cuda.synchronize()
                row["nan_ws"] = bool(o_ws.isnan().any())
                row["max_abs_diff_ws_vs_pointer"] = float((o_ws.float() - o_ptr.float()).abs().max())
                if S <= 8192:
                    ref = chunked_reference(q, kc, vc, bt, qsl, sl, hm, SINK, WINDOW)
                    base = chunked_reference(q, kc, vc, bt, qsl, sl, hm, SINK, WINDOW, compute_dtype=torch.bfloat16)
                    bound = 2 * float((base.float() - ref.float()).abs().max()) + 1e-3
                    row["err_ws_vs_fp32"] = float((o_ws.float() - ref.float()).abs().max())
                    row["err_pointer_vs_fp32"] = float((o_ptr.float() - ref.float()).abs().max())
                    row["bound"] = bound
                    row["ok"] = row["err_ws_vs_fp32"] <= bound and not row["nan_ws"]
                else:
                    row["ok"] = not row["nan_ws"] and row["max_abs_diff_ws_vs_pointer"] <= 0.05
                if row["ok"]:
                    for name, fn in (("ws", ws), ("pointer", ptr)):
                        r = bench(fn)
                        row[f"ms_{name}"] = r["ms"]
                        row[f"TFLOPs_{name}"] = flops / (r["ms"] * 1e-3) / 1e12
                    row["speedup_ws"] = row["ms_pointer"] / row["ms_ws"]
            except Exception as e:
                row["error"] = repr(e)[:400]
            report["rows"].append(row)
            print(row, flush=True)
            write_json(args.out, report)
        x = kc = vc = q = None
        torch.cuda.empty_cache()
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
