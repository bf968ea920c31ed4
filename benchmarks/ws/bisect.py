#!/usr/bin/env python3
# ruff: noqa: E402  (the parent part imports nothing heavy; the case part imports torch after it)
"""Bisect of Triton 3.6's Hopper warp specialization on the probe kernel (benchmarks/ws/probe.py, correct with WS):
one feature of csrc/prefill_ws.py added at a time, each variant in its own process (a bad build can hang or
corrupt the CUDA context), 2K tokens, 32 q / 8 KV heads, d 128, bf16, against a float32 reference.

    GIT_COMMIT=<sha> python3 benchmarks/ws/bisect.py --out benchmarks/results/dev/ws-bisect-h200.json [names...]

Variants: base (the probe); store_ptr (pointer store epilogue instead of a descriptor store); acc_in_dot
(``dot(p, v, acc * alpha)``); kv3d (3-D [blocks, bs, cols] K/V descriptors + reshape); dyn (a loaded trip count);
guard (``l > 0`` guard); zero_trip (trip count 0 on every other program); odd15 / odd1 (odd trip counts); mask
(causal ``where`` on the scores, per-program trip count up to the diagonal); mask2d / mask_bias / mask_on_p (the
same mask from a 2-D arange, as an additive bias, on P); mask_loadpos (row positions loaded from memory);
mask_even (mask, trip count padded to even); mask_nows (mask without WS, 8 warps: the control); mask_carry (the
mask from q_pos - k0 carried through the loop as a row vector, like m and l); mask_carry_store_ptr (and the
pointer store's rows from that carried vector); mask_opaque (q_pos from a base that is a different SSA value than
the Q descriptor's row coordinate: the offline TTGIR showed the second consumer adding its 64-row offset to that
shared scalar AND to its arange, i.e. twice); mask_opaque_store_ptr (and the pointer store through those rows).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _isolated import is_parent, run_cases

VARS = {
    "base": {}, "store_ptr": {"STORE_PTR": 1}, "acc_in_dot": {"ACC_IN_DOT": 1}, "kv3d": {"KV3D": 1},
    "dyn": {"DYN": 1}, "guard": {"GUARD": 1}, "zero_trip": {"ZERO": 1}, "odd15": {"ODD": 1}, "odd1": {"ODD": 2},
    "mask": {"MASK": 1}, "mask2d": {"MASK": 2}, "mask_bias": {"MASK": 4}, "mask_on_p": {"MASK": 5},
    "mask_loadpos": {"MASK": 3}, "mask_carry": {"MASK": 6}, "mask_opaque": {"MASK": 7},
    "mask_opaque_store_ptr": {"MASK": 7, "STORE_PTR": 1}, "mask_carry_store_ptr": {"MASK": 6, "STORE_PTR": 2}, "mask_even": {"MASK": 1, "EVEN": 1}, "mask_nows": {"MASK": 1, "NOWS": 1},
}  # fmt: skip
if __name__ == "__main__" and is_parent():
    run_cases(__file__, "Hopper autoWS bisect (benchmarks/ws/bisect.py)", "variant", VARS, 60)
    sys.exit(0)
import torch
import triton
import triton.language as tl


@triton.jit
def kern(
    q,
    k_cache,
    v_cache,
    block_table,
    o,
    S,
    n_rows,
    qk_scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BS: tl.constexpr,
    STORE_PTR: tl.constexpr,
    ACC_IN_DOT: tl.constexpr,
    KV3D: tl.constexpr,
    MASK: tl.constexpr,
    DYN: tl.constexpr,
    GUARD: tl.constexpr,
    ZERO: tl.constexpr,
    NOWS: tl.constexpr,
    ODD: tl.constexpr,
    EVEN: tl.constexpr,
    pos_ptr,
):
    i_m = tl.program_id(0)
    i_hq = tl.program_id(1)
    i_h = i_hq // (HQ // HKV)
    q_desc = tl.make_tensor_descriptor(q, shape=[S, HQ * D], strides=[HQ * D, 1], block_shape=[BM, D])
    if KV3D:
        k_desc = tl.make_tensor_descriptor(
            k_cache, shape=[n_rows // BS, BS, HKV * D], strides=[BS * HKV * D, HKV * D, 1], block_shape=[1, BN, D]
        )
        v_desc = tl.make_tensor_descriptor(
            v_cache, shape=[n_rows // BS, BS, HKV * D], strides=[BS * HKV * D, HKV * D, 1], block_shape=[1, BN, D]
        )
    else:
        k_desc = tl.make_tensor_descriptor(k_cache, shape=[n_rows, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(v_cache, shape=[n_rows, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
    b_q = q_desc.load([i_m * BM, i_hq * D])
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    q_pos = i_m * BM + tl.arange(0, BM)
    if MASK == 3:
        q_pos = tl.load(pos_ptr + i_m * BM + tl.arange(0, BM))
    if MASK == 7:  # the same positions from a base that is not the Q coordinate's SSA value (pos_ptr[0] = 0)
        q_pos = (i_m * BM + tl.load(pos_ptr)) + tl.arange(0, BM)
    if DYN:
        n_vis = tl.cdiv(i_m * BM + BM, BN) if MASK else tl.load(block_table + 0) * 0 + S // BN
    else:
        n_vis = S // BN
    if MASK:
        n_vis = tl.cdiv(i_m * BM + BM, BN)
    if ZERO:
        n_vis = tl.where(i_m % 2 == 1, 0, n_vis)
    if ODD == 1:
        n_vis = S // BN - 1
    if ODD == 2:
        n_vis = tl.load(block_table) * 0 + 1
    n_real = n_vis
    if EVEN:
        n_vis = n_vis + n_vis % 2
    if MASK == 6 or MASK == 7:
        n_vis = tl.cdiv(i_m * BM + BM, BN)
    rel = q_pos  # MASK 6: q_pos - k0 of the current tile, carried through the loop
    k_prev = i_m * 0
    for i_v in tl.range(0, n_vis, warp_specialize=not NOWS):
        if DYN:
            i_n = tl.where(i_v < 1, i_v, i_v)
        else:
            i_n = i_v
        k0 = i_n * BN
        blk = tl.load(block_table + k0 // BS)
        if KV3D:
            b_k = k_desc.load([blk, k0 % BS, i_h * D]).reshape(BN, D)
        else:
            b_k = k_desc.load([blk * BS + k0 % BS, i_h * D])
        b_s = tl.dot(b_q, b_k.T)
        j = k0 + tl.arange(0, BN)
        if MASK == 1 or MASK == 3 or MASK == 7:
            b_s = tl.where((q_pos[:, None] - j[None, :] >= 0) & (i_v < n_real), b_s, float("-inf"))
        if MASK == 2:
            b_s = tl.where(i_m * BM + tl.arange(0, BM)[:, None] >= k0 + tl.arange(0, BN)[None, :], b_s, float("-inf"))
        if MASK == 6:
            rel = rel - (k0 - k_prev)
            k_prev = k0
            b_s = tl.where(rel[:, None] - tl.arange(0, BN)[None, :] >= 0, b_s, float("-inf"))
        if MASK == 4:
            b_s = b_s + tl.where(q_pos[:, None] - j[None, :] >= 0, 0.0, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        b_p = tl.exp2(b_s * qk_scale - m_new[:, None])
        if MASK == 5:
            b_p = tl.where(q_pos[:, None] - j[None, :] >= 0, b_p, 0.0)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if KV3D:
            b_v = v_desc.load([blk, k0 % BS, i_h * D]).reshape(BN, D)
        else:
            b_v = v_desc.load([blk * BS + k0 % BS, i_h * D])
        if ACC_IN_DOT:
            acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None]
            acc = tl.dot(b_p.to(b_v.dtype), b_v, acc)
        m_i = m_new
    if GUARD:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    b_o = acc / l_i[:, None]
    if STORE_PTR == 2:
        o_d = tl.arange(0, D)
        rows = rel + k_prev
        p_o = o + (rows.to(tl.int64) * (HQ * D))[:, None] + (i_hq * D + o_d)[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(rows < S)[:, None])
    elif STORE_PTR:
        o_d = tl.arange(0, D)
        p_o = o + (q_pos.to(tl.int64) * (HQ * D))[:, None] + (i_hq * D + o_d)[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(q_pos < S)[:, None])
    else:
        o_desc = tl.make_tensor_descriptor(o, shape=[S, HQ * D], strides=[HQ * D, 1], block_shape=[BM, D])
        o_desc.store([i_m * BM, i_hq * D], b_o.to(o.dtype.element_ty))


v = sys.argv[2]
flags = {
    k: 0 for k in ("STORE_PTR", "ACC_IN_DOT", "KV3D", "MASK", "DYN", "GUARD", "ZERO", "NOWS", "ODD", "EVEN")
} | VARS[v]
flags["GUARD"] = 1
dev = torch.device("cuda")
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
S, HQ, HKV, D, BS = 2048, 32, 8, 128, 128
g = torch.Generator(device="cpu").manual_seed(0)
q = torch.randn(S, HQ, D, generator=g).to(dev, torch.bfloat16)
k = torch.randn(S, HKV, D, generator=g).to(dev, torch.bfloat16)
vv = torch.randn(S, HKV, D, generator=g).to(dev, torch.bfloat16)
nb = S // BS
perm = torch.randperm(nb, generator=g).to(dev)
kc = torch.empty(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16)
vc = torch.empty_like(kc)
kc[perm] = k.view(nb, BS, HKV, D)
vc[perm] = vv.view(nb, BS, HKV, D)
o = torch.full_like(q, float("nan"))
pos = torch.arange(S, device=dev, dtype=torch.int32)
kern[(S // 128, HQ)](
    q,
    kc,
    vc,
    perm.to(torch.int32),
    o,
    S,
    nb * BS,
    D**-0.5 * 1.4426950408889634,
    HQ=HQ,
    HKV=HKV,
    D=D,
    BM=128,
    BN=128,
    BS=BS,
    num_warps=4 if not flags["NOWS"] else 8,
    num_stages=2,
    pos_ptr=pos,
    **flags,
)
torch.cuda.synchronize()
kr = k.float().transpose(0, 1).repeat_interleave(4, 0)
vr = vv.float().transpose(0, 1).repeat_interleave(4, 0)
s = q.float().transpose(0, 1) @ kr.transpose(1, 2) * D**-0.5
if flags["ODD"]:
    nk = (S // 128 - 1) * 128 if flags["ODD"] == 1 else 128
    s[..., nk:] = float("-inf")
if flags["MASK"]:  # every MASK variant is the causal mask
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=dev).tril(), float("-inf"))
ref = (torch.softmax(s, -1) @ vr).transpose(0, 1)
if flags["ZERO"]:
    ref = ref.view(S // 128, 128, HQ, D).clone()
    ref[1::2] = 0
    ref = ref.view(S, HQ, D)
    flags["zero_rows_max"] = float(o.view(S // 128, 128, HQ, D)[1::2].float().abs().max())
print(
    json.dumps(
        {
            "max_abs_err": float((o.float() - ref).abs().max()),
            "nan_frac": float(o.isnan().float().mean()),
            "zero_trip_rows_max": flags.get("zero_rows_max"),
            "flags": flags,
        }
    )
)
