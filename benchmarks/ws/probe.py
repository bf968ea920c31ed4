#!/usr/bin/env python3
"""Probe: does Triton's Hopper automatic warp specialization (``tl.range(..., warp_specialize=True)``) raise
the tile rate of a plain flash-attention loop over a paged cache on this GPU?

    GIT_COMMIT=<sha> python3 benchmarks/ws/probe.py --out benchmarks/results/dev/ws-probe-h200.json

Why: the prefill kernel's FA tiles run at ~527 TFLOP/s, ~67% of the bf16 matmul peak, and the 1.3x targets over
FlexAttention need the softmax of one warpgroup to overlap the other's GEMMs (FA3's producer/consumer
warpgroups). Triton 3.6 has a Hopper pass for that (``add_hopper_warpspec``, Meta's autoWS). Offline sm_90 builds
(csrc/NOTES.md) show it splitting a single-loop kernel into a TMA producer and two 64-row consumer warpgroups,
and failing on the prefill kernel itself (several loops after the specialized one, the binary-search while loop,
a reshaped Q tile). This probe times the shape it does build before anyone restructures the real kernel for it.

Kernel: non-causal dense attention, 32 q / 8 KV heads, d 128, bf16, one query head per program (K/V tiles shared
through L2 by the 4 heads of a group), K/V read through device-side tensor descriptors from a paged cache with
block size 128 (one block-table read per tile, randomly permuted blocks). Variants: no WS (8 warps, 3 stages,
the prefill kernel's tiles) and WS (4 warps per partition, 2 and 3 stages). Checked against a float32 reference
on 2K tokens first; then timed at 8K and 32K (TFLOP/s = 4 S^2 d Hq / t). Not part of the product.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _gpu_common import bench, env_info, write_json  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 128


@triton.jit
def _probe_attn(q, k_cache, v_cache, block_table, o, S, n_rows, qk_scale,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BS: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """q, o: [HQ * S, D] (head-major); k_cache / v_cache: [n_blocks, BS, HKV, D]; block_table [S // BS]."""
    i_m = tl.program_id(0)
    i_hq = tl.program_id(1)
    i_h = i_hq // (HQ // HKV)
    q_desc = tl.make_tensor_descriptor(q, shape=[HQ * S, D], strides=[D, 1], block_shape=[BM, D])
    o_desc = tl.make_tensor_descriptor(o, shape=[HQ * S, D], strides=[D, 1], block_shape=[BM, D])
    k_desc = tl.make_tensor_descriptor(k_cache, shape=[n_rows, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
    v_desc = tl.make_tensor_descriptor(v_cache, shape=[n_rows, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
    b_q = q_desc.load([i_hq * S + i_m * BM, 0])
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for k0 in tl.range(0, S, BN, warp_specialize=WS):
        row = tl.load(block_table + k0 // BS) * BS + k0 % BS
        b_k = k_desc.load([row, i_h * D])
        b_s = tl.dot(b_q, b_k.T)
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
        b_p = tl.exp2(b_s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None]
        b_v = v_desc.load([row, i_h * D])
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc)
        m_i = m_new
    o_desc.store([i_hq * S + i_m * BM, 0], (acc / l_i[:, None]).to(o.dtype.element_ty))


def inputs(S: int, dev, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(HQ, S, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(S, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(S, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    nb = S // BS
    perm = torch.randperm(nb, device=dev, generator=g)
    kc = torch.empty(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    kc[perm] = k.view(nb, BS, HKV, D)
    vc[perm] = v.view(nb, BS, HKV, D)
    return q, k, v, kc, vc, perm.to(torch.int32)


def run(q, kc, vc, bt, S: int, ws: bool, num_warps: int, num_stages: int):
    o = torch.empty_like(q)
    grid = (S // 128, HQ)
    _probe_attn[grid](q.view(-1, D), kc, vc, bt, o.view(-1, D), S, kc.shape[0] * BS, D**-0.5 * 1.4426950408889634,
                      HQ=HQ, HKV=HKV, D=D, BM=128, BN=128, BS=BS, WS=ws, num_warps=num_warps,
                      num_stages=num_stages)  # fmt: skip
    return o


VARIANTS = (("no WS, 8 warps, 3 stages", False, 8, 3), ("WS, 4 warps, 2 stages", True, 4, 2),
            ("WS, 4 warps, 3 stages", True, 4, 3))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8192,32768")
    args = ap.parse_args()
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    report = {"what": "Hopper autoWS probe: plain FA loop over a paged cache", "env": env_info(), "rows": []}
    t0 = time.perf_counter()
    q, k, v, kc, vc, bt = inputs(2048, dev)
    kr = k.float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    vr = v.float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    ref = torch.softmax(q.float() @ kr.transpose(1, 2) * D**-0.5, -1) @ vr
    for name, ws, nw, ns in VARIANTS:
        row = {"variant": name, "warp_specialize": ws, "num_warps": nw, "num_stages": ns}
        try:
            err = (run(q, kc, vc, bt, 2048, ws, nw, ns).float() - ref).abs().max().item()
            row["check_max_abs_err"] = err
            row["check_ok"] = bool(err < 2e-2)
        except Exception as e:
            traceback.print_exc()
            row["error"] = repr(e)[:500]
        report["rows"].append(row)
        print(row, flush=True)
    for S in (int(s) for s in args.lengths.split(",")):
        q, _k, _v, kc, vc, bt = inputs(S, dev, seed=1)
        flops = 4.0 * S * S * D * HQ
        for name, ws, nw, ns in VARIANTS:
            ok = next(r for r in report["rows"] if r["variant"] == name and "S" not in r).get("check_ok")
            if not ok:
                continue
            r = bench(functools.partial(run, q, kc, vc, bt, S, ws, nw, ns))
            row = {"variant": name, "S": S, **r, "TFLOPs": flops / (r["ms"] * 1e-3) / 1e12}
            report["rows"].append(row)
            print(row, flush=True)
            write_json(args.out, report)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
