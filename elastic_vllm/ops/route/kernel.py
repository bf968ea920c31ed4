"""Attention Router on the GPU: boundary keys from the paged cache -> pre-RoPE -> pool -> MLPs -> decision.

Why one file of ~660 lines: one operator: the pool / task / router kernels share the packed weight layout and
the launch plan of ``Router`` (its reference: elastic_vllm/router/model.py).

For each routed request r (prompt of ``prompt_lens[r]`` tokens, block-table row ``req_rows[r]``)
and every KV head of ONE layer::

    y   = key_cache at the boundary positions (first / last pool_tokens, no token twice)  [P, Hkv, d]
    x   = invert_rope(y) = (y cos - rotate_half(y) sin) / attention_scaling            (fp32)
    x   = mean over the P positions                                                   [Hkv, d]
    f   = W2 silu(W1 x + b1) + b2                                    Task MLP   d -> 4d -> d
    z   = W5 silu(W4 silu(W3 f + b3) + b4) + b5                      Router MLP d -> 4d -> d -> 2
    table[slots[r], layer, h] = fa_value if z[h, 1] - z[h, 0] > -sa_margin else sa_value   (index 1 = FA; NaN / inf: FA)

Everything runs in float32 (as ``ElasticRouter`` does), so decisions match the reference except
where the two logits are within float32 rounding of each other.

Work split: two launches per layer, no spin barrier, no atomics on data (deterministic)::

    launch 1, grid (NS1, Hkv, R): program (s, h, r) pools head h of request r (~200 keys x d,
              51 KB at d 128; every slice recomputes it, which is cheaper than a third launch)
              and runs hidden slice s of the Task MLP: partial f[s] = W2[:, s] silu(W1[s] x + b1[s])
    launch 2, grid (NS2, Hkv, R): f = sum_s partial f[s] + b2 (fixed order), hidden slice s2 of the
              Router MLP: partial v[s2] = W4[:, s2] silu(W3[s2] f + b3[s2]); the last program of
              (r, h) to finish (a counter, no waiting) sums the partials in slice order, applies
              SiLU, Linear(d, 2), argmax, writes the table and re-arms the counter.

Each program reads 1/NS of the ~1 MB of fp32 weights of a layer (coalesced rows of nn.Linear's own
[out, in] layout), so no SM streams more than ~64 KB. "Whole" pooling (every prompt token) or a
long boundary pool runs a third, token-parallel pooling launch first. RoPE's angles are
``float(pos) * inv_freq`` as the reference computes them; their sin/cos come from a Cody-Waite
reduction by pi/2 and minimax polynomials (~1e-7 absolute), not from libdevice (whose slow path
for |angle| > 105615 - high frequencies past position ~105K - is a loop over local memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from elastic_vllm.ops._common import INDEX_DTYPES, MODE_DTYPES, check_tensor, next_pow2, resolve_pdl

FUSED_POOL_MAX = 512  # pooled positions up to which launch 1 pools by itself (boundary default: 200)
POOL_PROGRAMS = 32  # token-parallel pooling programs per (request, head) otherwise

_WS: dict = {}


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _sincos(x):
    """sin(x), cos(x) for fp32 x >= 0: x = k pi/2 + r, |r| <= pi/4 (two-term Cody-Waite with FMAs,
    exact to ~6e-8 up to |x| ~ 1e6), then degree-7/8 polynomials on r and the quadrant k mod 4."""
    k = tl.floor(x * 0.6366197723675814 + 0.5)
    r = tl.fma(k, -1.5707963705062866, x)  # fp32(pi/2)
    r = tl.fma(k, 4.371139000186243e-08, r)  # fp32(pi/2) - pi/2
    z = r * r
    s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    q = k.to(tl.int32) & 3
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    return sin, cos


@triton.jit
def _pool_step(a1, a2, ap, key_cache, p_bt, i_h, o_k, m_k, pool_tokens, shift, freq, s_kb, s_kt, s_kh,
               HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BLOCK_P: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    """Adds the un-rotated keys of head i_h at pooled tokens o_k [BT] (m_k: valid) to the running 2-D
    sums [BT, BLOCK_HALF] (first rotary half, second half) and [BT, BLOCK_P] (pass-through dims); the
    position of pooled token k is k < pool_tokens ? k : k + shift. Element-wise only: no reduction,
    hence no CTA barrier between steps, so the loads of every step can issue before the first one's
    math (``_pool_sums`` reduces once)."""
    o_i = tl.arange(0, BLOCK_HALF)
    m_i = o_i < HALF
    pos = tl.where(o_k < pool_tokens, o_k, o_k + shift)  # [BT]
    i_blk = tl.load(p_bt + pos // BS, mask=m_k, other=0).to(tl.int64)
    o_row = i_blk * s_kb + (pos % BS).to(tl.int64) * s_kt + i_h * s_kh  # [BT]
    m_2 = m_k[:, None] & m_i[None, :]
    p_y = key_cache + o_row[:, None] + o_i[None, :]
    y1 = tl.load(p_y, mask=m_2, other=0.0).to(tl.float32)  # [BT, BHALF]
    y2 = tl.load(p_y + HALF, mask=m_2, other=0.0).to(tl.float32)
    sin, cos = _sincos(pos.to(tl.float32)[:, None] * freq[None, :])  # the reference's fp32 angle
    a1 += y1 * cos + y2 * sin  # masked entries are 0 in y1 and y2
    a2 += y2 * cos - y1 * sin
    if ROT < D:
        o_p = tl.arange(0, BLOCK_P)
        yp = tl.load(key_cache + o_row[:, None] + ROT + o_p[None, :], mask=m_k[:, None] & (o_p < D - ROT)[None, :],
                     other=0.0)  # fmt: skip
        ap += yp.to(tl.float32)
    return a1, a2, ap


@triton.jit
def _pool_sums(key_cache, p_bt, i_h, k_first, k_end, k_step, pool_tokens, shift, inv_freq, s_kb, s_kt, s_kh,
               HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Sums (``_pool_step``) over pooled positions k in [k_first, k_end), runs of BLOCK_T tokens every
    k_step, reduced over the tokens once at the end. NT > 0: exactly NT steps, unrolled
    (k_end <= k_first + NT * k_step). Why 2-D sums: with a reduction per step (v2) the sm_90 build put
    six CTA barriers between one step's key loads and the next step's block-id load, so the 7 steps
    of the default pool ran as 7 x (block-id latency + key latency): ~16 us per program on the H200
    (launch 1 took 19.5 us per layer, 66 us with 8 requests = 4 waves of programs). NT = 0: a runtime
    loop (long pools)."""
    o_i = tl.arange(0, BLOCK_HALF)
    freq = tl.load(inv_freq + o_i, mask=o_i < HALF, other=0.0)  # [BHALF]
    a1 = tl.zeros([BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    ap = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    if NT > 0:
        for i_k in tl.static_range(NT):
            o_k = k_first + i_k * k_step + tl.arange(0, BLOCK_T)
            a1, a2, ap = _pool_step(a1, a2, ap, key_cache, p_bt, i_h, o_k, o_k < k_end, pool_tokens, shift, freq,
                                    s_kb, s_kt, s_kh, HALF, ROT, D, BLOCK_HALF, BLOCK_P, BS)  # fmt: skip
    else:
        for k0 in range(k_first, k_end, k_step):
            o_k = k0 + tl.arange(0, BLOCK_T)
            a1, a2, ap = _pool_step(a1, a2, ap, key_cache, p_bt, i_h, o_k, o_k < k_end, pool_tokens, shift, freq,
                                    s_kb, s_kt, s_kh, HALF, ROT, D, BLOCK_HALF, BLOCK_P, BS)  # fmt: skip
    return tl.sum(a1, 0), tl.sum(a2, 0), tl.sum(ap, 0)


# s_bt (the block table's row stride) follows max_model_len: specialised, the warm-up's table compiled another
# variant than the engine's (tests/vllm_cpu/test_warmup_variants.py)
@triton.jit(do_not_specialize=["s_bt", "pool_tokens"])
def _route_pool_kernel(
    key_cache, block_table, req_rows, prompt_lens, inv_freq, ws_pool, s_kb, s_kt, s_kh, s_bt, pool_tokens,
    HKV: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, NPOOL: tl.constexpr,
):  # fmt: skip
    """Token-parallel pooling (long pools): program c sums token runs c, c + NPOOL, ... of head h."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_r = tl.program_id(2)
    n_len = tl.load(prompt_lens + i_r)
    n_pool = tl.minimum(n_len, 2 * pool_tokens)
    p_bt = block_table + tl.load(req_rows + i_r).to(tl.int64) * s_bt
    x1, x2, xp = _pool_sums(
        key_cache, p_bt, i_h, i_c * BLOCK_T, n_pool, NPOOL * BLOCK_T, pool_tokens, n_len - n_pool, inv_freq,
        s_kb, s_kt, s_kh, HALF, ROT, D, BLOCK_HALF, BLOCK_P, BLOCK_T, BS, 0,
    )  # fmt: skip
    p_o = ws_pool + ((i_r * HKV + i_h) * NPOOL + i_c).to(tl.int64) * D
    o_i = tl.arange(0, BLOCK_HALF)
    o_p = tl.arange(0, BLOCK_P)
    tl.store(p_o + o_i, x1, mask=o_i < HALF)
    tl.store(p_o + HALF + o_i, x2, mask=o_i < HALF)
    if ROT < D:
        tl.store(p_o + ROT + o_p, xp, mask=o_p < D - ROT)


@triton.jit(do_not_specialize=["s_bt", "layer", "pool_tokens"])
def _route_task_kernel(
    key_cache, block_table, req_rows, prompt_lens, inv_freq, weights, ws_pool, ws_f, norm,
    s_kb, s_kt, s_kh, s_bt, s_w, layer, pool_tokens, attention_scaling,
    HKV: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, HID: tl.constexpr,
    NS1: tl.constexpr, FUSED_POOL: tl.constexpr, NPOOL: tl.constexpr, HAS_NORM: tl.constexpr,
    NT_POOL: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Launch 1: pool head h (or sum the pooling launch's partials), Task MLP hidden slice s.
    USE_PDL: lets launch 2 start (and load its weights) as soon as every program here has started."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_r = tl.program_id(2)
    CH: tl.constexpr = HID // NS1
    n_len = tl.load(prompt_lens + i_r)
    n_pool = tl.minimum(n_len, 2 * pool_tokens)
    o_i = tl.arange(0, BLOCK_HALF)
    m_i = o_i < HALF
    o_p = tl.arange(0, BLOCK_P)
    m_p = o_p < D - ROT
    o_j = i_s * CH + tl.arange(0, CH)  # [CH] this program's hidden units
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    if FUSED_POOL:
        p_bt = block_table + tl.load(req_rows + i_r).to(tl.int64) * s_bt
        x1, x2, xp = _pool_sums(
            key_cache, p_bt, i_h, 0, n_pool, BLOCK_T, pool_tokens, n_len - n_pool, inv_freq,
            s_kb, s_kt, s_kh, HALF, ROT, D, BLOCK_HALF, BLOCK_P, BLOCK_T, BS, NT_POOL,
        )  # fmt: skip
    else:
        # the NPOOL partials in one 2-D load each (one memory latency), summed by a fixed tree
        p_x = ws_pool + ((i_r * HKV + i_h) * NPOOL).to(tl.int64) * D + tl.arange(0, NPOOL)[:, None] * D
        x1 = tl.sum(tl.load(p_x + o_i[None, :], mask=m_i[None, :], other=0.0), 0)
        x2 = tl.sum(tl.load(p_x + HALF + o_i[None, :], mask=m_i[None, :], other=0.0), 0)
        if ROT < D:
            xp = tl.sum(tl.load(p_x + ROT + o_p[None, :], mask=m_p[None, :], other=0.0), 0)
        else:
            xp = tl.zeros([BLOCK_P], dtype=tl.float32)
    # weights after the pool's loads (source order): see the note in _pool_sums
    p_w = weights + layer.to(tl.int64) * s_w
    p_w1 = p_w + o_j[:, None] * D  # W1 [HID, D] rows
    w1a = tl.load(p_w1 + o_i[None, :], mask=m_i[None, :], other=0.0)  # [CH, BHALF]
    w1b = tl.load(p_w1 + HALF + o_i[None, :], mask=m_i[None, :], other=0.0)
    b1 = tl.load(p_w + HID * D + o_j)
    # W2 [D, HID]: element (d, j) at d * HID + j, read as [CH, BD] (j contiguous)
    w2 = tl.load(p_w + HID * D + HID + o_d[None, :] * HID + o_j[:, None], mask=m_d[None, :], other=0.0)
    inv_n = 1.0 / n_pool.to(tl.float32)
    x1 = x1 * (inv_n / attention_scaling)
    x2 = x2 * (inv_n / attention_scaling)
    xp = xp * inv_n
    if HAS_NORM:  # the router's input standardization: (x - shift[layer, h]) * scale[layer, h]
        p_n = norm + (layer * HKV + i_h).to(tl.int64) * (2 * D)  # [L, HKV, 2, D]: shift, scale
        x1 = (x1 - tl.load(p_n + o_i, mask=m_i, other=0.0)) * tl.load(p_n + D + o_i, mask=m_i, other=0.0)
        x2 = (x2 - tl.load(p_n + HALF + o_i, mask=m_i, other=0.0)) * tl.load(p_n + D + HALF + o_i, mask=m_i, other=0.0)
        if ROT < D:
            xp = (xp - tl.load(p_n + ROT + o_p, mask=m_p, other=0.0)) * tl.load(
                p_n + D + ROT + o_p, mask=m_p, other=0.0
            )
    h_pre = tl.sum(w1a * x1[None, :], 1) + tl.sum(w1b * x2[None, :], 1) + b1  # [CH]
    if ROT < D:
        w1p = tl.load(p_w1 + ROT + o_p[None, :], mask=m_p[None, :], other=0.0)
        h_pre += tl.sum(w1p * xp[None, :], 1)
    hid = _silu(h_pre)
    f_part = tl.sum(w2 * hid[:, None], 0)  # [BD]
    tl.store(ws_f + ((i_r * HKV + i_h) * NS1 + i_s).to(tl.int64) * D + o_d, f_part, mask=m_d)


@triton.jit(do_not_specialize=["layer", "fa_value", "sa_value", "neg_margin", "e_batch", "e_layers", "decode_dense"])
def _route_router_kernel(
    weights, ws_f, ws_v, cnt, slots, table, logits, s_w, s_t0, s_t1, s_t2, layer, fa_value, sa_value, neg_margin,
    e_info, e_thr, e_floor, e_step, e_modes, e_fa, e_logits, e_batch, e_layers, decode_dense,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HID: tl.constexpr, NS1: tl.constexpr,
    NS2: tl.constexpr, HAS_LOGITS: tl.constexpr, USE_PDL: tl.constexpr, EPILOGUE: tl.constexpr,
):  # fmt: skip
    """Launch 2: Router MLP hidden slice s2; the last slice program of (r, h) finishes the head.
    USE_PDL: launched as a programmatic dependent of launch 1: every weight load is issued before
    ``griddepcontrol.wait``, the first read of launch 1's output, so the weights arrive while launch 1
    still runs. EPILOGUE: the finishing program also applies the routing policy (``router/policy.py``:
    each row's own threshold ``e_thr[r]``, the floor, the row's force, decode-phase modes) and writes the
    engine's per-step and per-request tables (``RouteEpilogue``; ``e_*`` are its tensors, None without it)."""
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_r = tl.program_id(2)
    CH: tl.constexpr = HID // NS2
    OFF_W3: tl.constexpr = 2 * HID * D + HID + D
    OFF_W4: tl.constexpr = OFF_W3 + HID * D + HID
    OFF_W5: tl.constexpr = OFF_W4 + D * HID + D
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_j = i_s * CH + tl.arange(0, CH)
    p_w = weights + layer.to(tl.int64) * s_w
    w3 = tl.load(p_w + OFF_W3 + o_j[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0.0)  # [CH, BD]
    b3 = tl.load(p_w + OFF_W3 + HID * D + o_j)
    w4 = tl.load(p_w + OFF_W4 + o_d[None, :] * HID + o_j[:, None], mask=m_d[None, :], other=0.0)  # [CH, BD]
    i_rh = i_r * HKV + i_h
    f = tl.load(p_w + 2 * HID * D + HID + o_d, mask=m_d, other=0.0)  # b2
    # the finishing program's weights, loaded by every program before the counter (off the tail)
    b4 = tl.load(p_w + OFF_W4 + D * HID + o_d, mask=m_d, other=0.0)
    w5a = tl.load(p_w + OFF_W5 + o_d, mask=m_d, other=0.0)
    w5b = tl.load(p_w + OFF_W5 + D + o_d, mask=m_d, other=0.0)
    b5a = tl.load(p_w + OFF_W5 + 2 * D)
    b5b = tl.load(p_w + OFF_W5 + 2 * D + 1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # launch 1 complete, its partials visible
    # the NS1 Task-MLP partials in one 2-D load (one memory latency, not NS1), a fixed-order tree sum
    p_f = ws_f + (i_rh * NS1).to(tl.int64) * D + tl.arange(0, NS1)[:, None] * D + o_d[None, :]
    f += tl.sum(tl.load(p_f, mask=m_d[None, :], other=0.0), 0)
    u = _silu(tl.sum(w3 * f[None, :], 1) + b3)  # [CH]
    v_part = tl.sum(w4 * u[:, None], 0)  # [BD]
    p_v = ws_v + (i_rh * NS2).to(tl.int64) * D
    tl.store(p_v + i_s * D + o_d, v_part, mask=m_d)
    tl.debug_barrier()  # every thread's partial is written before the counter moves (release below)
    done = tl.atomic_add(cnt + i_rh, 1, sem="acq_rel")
    if done == NS2 - 1:
        # all NS2 partials in one 2-D load; a fixed tree: the result does not depend on which program is last
        p_vv = p_v + tl.arange(0, NS2)[:, None] * D + o_d[None, :]
        v = b4 + tl.sum(tl.load(p_vv, mask=m_d[None, :], other=0.0, cache_modifier=".cg"), 0)
        v = _silu(v)
        z0 = tl.sum(v * w5a, 0) + b5a
        z1 = tl.sum(v * w5b, 0) + b5b
        # FA iff z1 - z0 > -sa_margin in float32, as router.model.decide (margin 0: ties -> SA, as torch.argmax);
        # non-finite logits (NaN / inf) -> FA, the mode that drops nothing
        if EPILOGUE:  # each row its own float32 threshold bias - sa_margin (policy.thresholds)
            thr = tl.load(e_thr + i_r)
        else:
            thr = neg_margin
        is_fa = ((z1 - z0) > thr) | ~((tl.abs(z0) < float("inf")) & (tl.abs(z1) < float("inf")))
        dec = tl.where(is_fa, fa_value, sa_value)
        i_slot = tl.load(slots + i_r).to(tl.int64)
        tl.store(table + i_slot * s_t0 + layer * s_t1 + i_h * s_t2, dec.to(table.dtype.element_ty))
        if HAS_LOGITS:
            tl.store(logits + i_rh * 2, z0)
            tl.store(logits + i_rh * 2 + 1, z1)
        if EPILOGUE:
            # router/policy.py's route_heads without budgets: floor heads FA; force 0 auto, 1 all-FA, 2 all-SA
            # over that; decode-phase rows: dense -> FA, sparse -> SSA stays, else FA
            R = tl.num_programs(2)
            fa = is_fa | (tl.load(e_floor + layer * HKV + i_h).to(tl.int32) != 0)
            frc = tl.load(e_info + R + i_r)
            fa = tl.where(frc == 1, True, tl.where(frc == 2, False, fa))
            mode = tl.where(fa, fa_value, sa_value)
            dmode = tl.where((decode_dense == 0) & (mode == 1), 1, 0)
            smode = tl.where(tl.load(e_info + 2 * R + i_r) != 0, dmode, mode)
            i_row = tl.load(e_info + i_r).to(tl.int64)
            tl.store(e_step + (layer * e_batch + i_row) * HKV + i_h, smode.to(e_step.dtype.element_ty))
            i_fs = tl.load(e_info + 3 * R + i_r).to(tl.int64)
            if i_fs >= 0:  # the request's final routing: its per-request tables
                o_t = (i_fs * e_layers + layer) * HKV + i_h
                tl.store(e_modes + o_t, mode.to(e_modes.dtype.element_ty))
                tl.store(e_fa + o_t, fa.to(e_fa.dtype.element_ty))
                tl.store(e_logits + o_t * 2, z0)
                tl.store(e_logits + o_t * 2 + 1, z1)
        tl.atomic_xchg(cnt + i_rh, 0)  # re-armed for the next layer (stream order)


@dataclass
class RouteEpilogue:
    """What the finishing program writes besides the decision table: the routing policy of
    ``elastic_vllm/router/policy.py`` (``route_heads`` without budgets) and its tables, fused.

    For routed row r (of R) and KV head h at ``layer``: fa = z_FA - z_SA > ``thresholds[r]`` (NaN / inf: FA),
    or ``floor[layer, h]``; overridden by the row's force (0 auto, 1 all-FA, 2 all-SA); mode = fa_value if fa
    else sa_value; the row's mode for this step = mode, or for decode-phase rows FA (``decode_dense``) or
    SSA-stays-SSA-else-FA (sparse); ``tables.step_modes[layer, batch row, h]`` = that mode; where the row's
    final slot s >= 0 also ``tables.modes[s, layer, h]`` = mode, ``tables.fa[s, layer, h]`` = fa,
    ``tables.logits[s, layer, h]`` = the two logits.

    ``row_info`` int32 [4, R]: batch row, force, decode phase (0 / 1), final slot (-1: none), contiguous;
    ``thresholds`` float32 [R]; ``floor`` [L, Hkv] int8 / uint8 / bool; ``tables``: a
    ``policy.RoutingTables`` (step_modes [L, B, Hkv], modes and fa [S, L, Hkv], logits [S, L, Hkv, 2]; any
    integer / bool / float32 dtypes of those shapes, contiguous).
    """

    row_info: torch.Tensor
    thresholds: torch.Tensor
    floor: torch.Tensor
    tables: Any
    decode_dense: bool


ROW_ALIGN = 16  # floats: packed rows start 64-byte aligned


def router_param_count(head_dim: int, hidden: int) -> int:
    """Floats per layer in the packed layout: W1 b1 W2 b2 (Task MLP), W3 b3 W4 b4 W5 b5 (Router MLP)."""
    return 4 * hidden * head_dim + 2 * hidden + 4 * head_dim + 2


def packed_row_len(head_dim: int, hidden: int) -> int:
    """Row length of ``pack_router_weights``: the parameters, zero-padded to a multiple of ROW_ALIGN floats.
    Why: with 263,682 floats per row at d 128 every other layer's row started 8 bytes off a 16-byte boundary,
    and the sm_90 build of both router kernels loaded every weight with 4-byte loads (75 of 91 loads of the
    Task-MLP kernel were LDG.E); a 16-float row stride lets Triton prove 16-byte alignment (LDG.E.128).
    ``tools/sm90_build.py`` -> benchmarks/results/experiments/sm90-build.json has both builds."""
    n = router_param_count(head_dim, hidden)
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def _hidden_of_row(p: int, head_dim: int) -> int | None:
    """The hidden width (a power of two >= 16) whose packed row, padded or not, has p floats."""
    h = 16
    while router_param_count(head_dim, h) <= p:
        if p in (router_param_count(head_dim, h), packed_row_len(head_dim, h)):
            return h
        h *= 2
    return None


def pack_router_norm(router) -> torch.Tensor | None:
    """[L, Hkv, 2, d] float32 (shift, scale) of an ``ElasticRouter``'s input standardization, or None."""
    if getattr(router, "input_shift", None) is None:
        return None
    return torch.stack([router.input_shift, router.input_scale], 2).float().contiguous()


def pack_router_weights(router) -> torch.Tensor:
    """[L, P] float32 contiguous: each row the layer's weights in nn.Linear order
    (W1 [4d, d], b1, W2 [d, 4d], b2, W3 [4d, d], b3, W4 [d, 4d], b4, W5 [2, d], b5), then zeros up to
    ``packed_row_len`` (aligned rows; ``Router`` also accepts unpadded rows of ``router_param_count``).

    ``router`` is an ``ElasticRouter`` (anything with ``.layers[i].cls_feat_extractor`` and
    ``.cls_router_head_agnostic`` Sequentials). Pack once at load time, not per step.
    """
    rows = []
    for lr in router.layers:
        t, r = lr.cls_feat_extractor, lr.cls_router_head_agnostic
        parts = [t[0].weight, t[0].bias, t[2].weight, t[2].bias]
        parts += [r[0].weight, r[0].bias, r[2].weight, r[2].bias, r[4].weight, r[4].bias]
        row = torch.cat([p.detach().float().reshape(-1) for p in parts])
        pad = -row.numel() % ROW_ALIGN
        rows.append(torch.cat([row, row.new_zeros(pad)]))
    return torch.stack(rows).contiguous()


class Router:
    """Prepared router launcher for the hot path: validate and precompute once, launch per layer.

    ``Router(weights, table, inv_freq=..., ...)`` checks the static inputs (packed weights, decision
    table, RoPE frequencies) and fixes the launch metadata; each ``router(key_cache, block_table,
    req_rows, prompt_lens, slots, layer)`` then only reads strides and launches two kernels (three
    for long pools) with no validation, allocation or host sync. ``route()`` is the checked
    one-shot equivalent. ``num_chunks`` overrides the hidden slices per MLP pair (NS1 = NS2).
    ``pdl``: launch 2 as a programmatic dependent launch of launch 1 (default: on sm_90+ CUDA; True on
    any other device is a ValueError); launch 1 is an ordinary launch, it reads the key cache.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        table: torch.Tensor,
        *,
        inv_freq: torch.Tensor,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        attention_scaling: float = 1.0,
        pool_tokens: int = 100,
        pooling: str = "boundary",
        fa_value: int = 0,
        sa_value: int = 1,
        num_chunks: int | None = None,
        norm: torch.Tensor | None = None,
        pdl: bool | None = None,
        sa_margin: float = 0.0,
    ):
        dev = weights.device
        self.neg_margin = _neg_margin(sa_margin)
        d, hkv = head_dim, num_kv_heads
        check_tensor(weights, "weights", dim=2, dtypes=(torch.float32,))
        if not weights.is_contiguous():
            raise ValueError("weights: must be contiguous (use pack_router_weights)")
        num_layers, p = weights.shape
        hidden = _hidden_of_row(p, d)
        if hidden is None:
            raise ValueError(f"weights: {p} floats per layer is not a packed router for head_dim {d}")
        check_tensor(table, "table", dim=3, dtypes=MODE_DTYPES, shape=(None, num_layers, hkv), device=dev)
        check_tensor(inv_freq, "inv_freq", dim=1, dtypes=(torch.float32,), device=dev)
        if norm is not None:
            check_tensor(norm, "norm", dim=4, dtypes=(torch.float32,), shape=(num_layers, hkv, 2, d), device=dev)
            if not norm.is_contiguous():
                raise ValueError("norm: must be contiguous (use pack_router_norm)")
        self.norm = norm
        self.pdl = resolve_pdl(pdl, dev)
        rot = 2 * inv_freq.shape[0]
        if rot == 0 or rot > d:
            raise ValueError(f"inv_freq: rotary_dim {rot} must be in (0, head_dim {d}]")
        if pooling not in ("boundary", "whole"):
            raise ValueError(f"pooling: expected 'boundary' or 'whole', got {pooling!r}")
        if pool_tokens < 1:
            raise ValueError(f"pool_tokens: must be >= 1, got {pool_tokens}")
        if num_chunks is not None and (num_chunks < 1 or num_chunks & (num_chunks - 1) or hidden // num_chunks < 16):
            raise ValueError(f"num_chunks: a power of two with hidden/num_chunks >= 16 required, got {num_chunks}")
        # slices: ~64 KB of fp32 weights per program at d 128 (launch 1 also pools: fewer, larger slices)
        self.ns1 = num_chunks or max(1, min(hidden // 16, hidden // 64))
        self.ns2 = num_chunks or max(1, min(hidden // 16, hidden // 32))
        n = min(pool_tokens, 1 << 29) if pooling == "boundary" else 1 << 29  # 2n must fit in int32
        self.fused_pool = pooling == "boundary" and 2 * n <= FUSED_POOL_MAX
        self.device, self.num_layers, self.hidden, self.d, self.hkv = dev, num_layers, hidden, d, hkv
        self.weights, self.table, self.inv_freq = weights, table, inv_freq
        self.pool_tokens, self.scaling = n, float(attention_scaling)
        self.fa_value, self.sa_value = int(fa_value), int(sa_value)
        half = rot // 2
        self.pool_meta = dict(
            HKV=hkv, HALF=half, ROT=rot, D=d, BLOCK_HALF=max(16, next_pow2(half)),
            BLOCK_P=max(16, next_pow2(d - rot)), BLOCK_T=32, BS=block_size,
        )  # fmt: skip
        self.task_meta = dict(
            self.pool_meta, BLOCK_D=max(16, next_pow2(d)), HID=hidden, NS1=self.ns1,
            FUSED_POOL=self.fused_pool, NPOOL=POOL_PROGRAMS, HAS_NORM=norm is not None, num_warps=8,
            NT_POOL=triton.cdiv(2 * n, 32) if self.fused_pool else 1, USE_PDL=self.pdl,
        )  # fmt: skip
        self.router_meta = dict(HKV=hkv, D=d, BLOCK_D=max(16, next_pow2(d)), HID=hidden, NS1=self.ns1, NS2=self.ns2,
                                USE_PDL=self.pdl, num_warps=4)  # fmt: skip
        if self.pdl:
            self.router_meta["launch_pdl"] = True

    def workspace(self, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pool partials, Task-MLP partials, Router-MLP partials, counters) for R requests, cached per
        device and shape for the process (``route()`` builds a Router per call). The counters start
        at zero and are re-armed by the kernel itself; launches on one stream never overlap."""
        key = (self.device, R, self.hkv, self.d, self.ns1, self.ns2, self.fused_pool)
        ws = _WS.get(key)
        if ws is None:
            f32 = dict(device=self.device, dtype=torch.float32)
            pool = torch.empty(R * self.hkv * POOL_PROGRAMS * self.d if not self.fused_pool else 1, **f32)
            ws = _WS[key] = (
                pool,
                torch.empty(R * self.hkv * self.ns1 * self.d, **f32),
                torch.empty(R * self.hkv * self.ns2 * self.d, **f32),
                torch.zeros(R * self.hkv, device=self.device, dtype=torch.int32),
            )
        return ws

    def __call__(
        self,
        key_cache: torch.Tensor,
        block_table: torch.Tensor,
        req_rows: torch.Tensor,
        prompt_lens: torch.Tensor,
        slots: torch.Tensor,
        layer: int,
        logits_out: torch.Tensor | None = None,
        stages: tuple[str, ...] = ("task", "router"),
        epilogue: RouteEpilogue | None = None,
        fa_value: int | None = None,
        sa_value: int | None = None,
        sa_margin: float | None = None,
    ) -> None:
        """Route at one layer. ``stages`` picks launches (the benchmark times each alone); ``epilogue``:
        the engine tables to write as well (``RouteEpilogue``; checked by ``check_epilogue``, not here; its
        per-row thresholds replace ``sa_margin``); ``fa_value`` / ``sa_value`` / ``sa_margin`` override the
        constructor's values for this call."""
        R = req_rows.shape[0]
        if R == 0:
            return
        pool, ws_f, ws_v, cnt = self.workspace(R)
        ks = key_cache.stride()
        bts = block_table.stride(0)
        sw = self.weights.stride(0)
        if not self.fused_pool and "task" in stages:
            _route_pool_kernel[(POOL_PROGRAMS, self.hkv, R)](
                key_cache, block_table, req_rows, prompt_lens, self.inv_freq, pool, ks[0], ks[1], ks[2], bts,
                self.pool_tokens, NPOOL=POOL_PROGRAMS, num_warps=4, **self.pool_meta,
            )  # fmt: skip
        if "task" in stages:
            _route_task_kernel[(self.ns1, self.hkv, R)](
                key_cache, block_table, req_rows, prompt_lens, self.inv_freq, self.weights, pool, ws_f,
                self.norm if self.norm is not None else self.weights,
                ks[0], ks[1], ks[2], bts, sw, layer, self.pool_tokens, self.scaling, **self.task_meta,
            )  # fmt: skip
        ts = self.table.stride()
        if "router" in stages:
            fv = self.fa_value if fa_value is None else int(fa_value)
            sv = self.sa_value if sa_value is None else int(sa_value)
            nm = self.neg_margin if sa_margin is None else _neg_margin(sa_margin)
            if epilogue is None:
                ep = (None,) * 7 + (0, 0, 0)
            else:
                e, t = epilogue, epilogue.tables
                ep = (e.row_info, e.thresholds, e.floor, t.step_modes, t.modes, t.fa, t.logits, t.step_modes.shape[1],
                      t.modes.shape[1], int(e.decode_dense))  # fmt: skip
            _route_router_kernel[(self.ns2, self.hkv, R)](
                self.weights, ws_f, ws_v, cnt, slots, self.table, logits_out, sw, ts[0], ts[1], ts[2], layer, fv, sv,
                nm, *ep, HAS_LOGITS=logits_out is not None, EPILOGUE=epilogue is not None, **self.router_meta,
            )  # fmt: skip


def _neg_margin(sa_margin) -> float:
    """The kernel's float32 threshold -sa_margin; a bool, a non-number or a non-finite value is an error."""
    import math

    if isinstance(sa_margin, bool) or not isinstance(sa_margin, (int, float)) or not math.isfinite(sa_margin):
        raise ValueError(f"sa_margin: must be a finite number, got {sa_margin!r}")
    return -float(sa_margin)


def check_epilogue(e: RouteEpilogue, R: int, num_layers: int, num_kv_heads: int, device) -> None:
    """The shapes, dtypes and devices ``Router.__call__`` assumes for ``epilogue`` (a clear error each)."""
    t = e.tables
    named = (
        (e.row_info, "row_info", dict(dim=2, dtypes=(torch.int32,), shape=(4, R))),
        (e.thresholds, "thresholds", dict(dim=1, dtypes=(torch.float32,), shape=(R,))),
        (e.floor, "floor", dict(dim=2, dtypes=(torch.int8, torch.uint8, torch.bool), shape=(num_layers, num_kv_heads))),
        (t.step_modes, "step_modes", dict(dim=3, dtypes=MODE_DTYPES, shape=(num_layers, None, num_kv_heads))),
        (t.modes, "modes", dict(dim=3, dtypes=MODE_DTYPES, shape=(None, num_layers, num_kv_heads))),
        (t.fa, "fa", dict(dim=3, dtypes=(torch.bool, *MODE_DTYPES), shape=(t.modes.shape[0], num_layers, num_kv_heads))),
        (t.logits, "logits", dict(dim=4, dtypes=(torch.float32,), shape=(t.modes.shape[0], num_layers, num_kv_heads, 2))),
    )  # fmt: skip
    for tensor, name, kw in named:
        check_tensor(tensor, name, device=device, **kw)
        if not tensor.is_contiguous():  # the kernel derives the strides from the shapes
            raise ValueError(f"{name}: must be contiguous, got strides {tensor.stride()}")


def check_key_cache(key_cache: torch.Tensor) -> None:
    """A paged key cache the router kernels can read: [num_blocks, block_size, Hkv, d], 16/32-bit float,
    d contiguous (what ``Router.__call__`` assumes without checking)."""
    check_tensor(key_cache, "key_cache", dim=4, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if key_cache.stride(-1) != 1:
        raise ValueError(f"key_cache: last dimension must be contiguous, got strides {key_cache.stride()}")


def route(
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    prompt_lens: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    *,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    pool_tokens: int = 100,
    pooling: str = "boundary",
    fa_value: int = 0,
    sa_value: int = 1,
    logits_out: torch.Tensor | None = None,
    num_chunks: int | None = None,
    norm: torch.Tensor | None = None,
    epilogue: RouteEpilogue | None = None,
    sa_margin: float = 0.0,
) -> torch.Tensor:
    """Route ``R`` requests at one layer and write their decisions into ``table`` in place.

    Args:
        key_cache: [num_blocks, block_size, Hkv, d] POST-RoPE keys of this layer (any strides).
        block_table: [B, max_blocks] int32; req_rows [R] int32 picks each routed request's row.
        prompt_lens: [R] int32 prompt length of each routed request (its prompt is in the cache).
        slots: [R] int32 row of ``table`` for each request.
        weights: [L, P] float32 from ``pack_router_weights``.
        layer: the layer index (Python int), used for the weights row and the table column.
        table: [slots, L, Hkv] int (HeadMode per request, layer, KV head), written at
            table[slots[r], layer, :] = fa_value (z1 - z0 > -sa_margin: the router prefers SA by less
            than the margin) or sa_value.
        inv_freq: [rotary_dim / 2] float32, the model's RoPE frequencies (``RopeSpec.inv_freq``);
            attention_scaling: RoPE's magnitude scaling (``RopeSpec.attention_scaling``).
        pool_tokens, pooling: "boundary" = mean of the first/last pool_tokens; "whole" = all.
        logits_out: optional [R, Hkv, 2] float32, receives the router logits.
        num_chunks: hidden slices per MLP pair (see ``Router``).
        norm: optional [L, Hkv, 2, d] float32 input standardization from ``pack_router_norm``.
        epilogue: optional engine tables to write as well (``RouteEpilogue``: per-row thresholds, the floor,
            forced rows, decode-phase modes, the per-step row modes and the per-request tables).
        sa_margin: ``ElasticConfig.sa_margin`` (finite float; 0 = the argmax).

    Returns:
        table. No host synchronisation.
    """
    check_key_cache(key_cache)
    dev = key_cache.device
    _nb, bs, hkv, d = key_cache.shape
    check_tensor(block_table, "block_table", dim=2, dtypes=INDEX_DTYPES, device=dev)
    R = req_rows.shape[0] if isinstance(req_rows, torch.Tensor) else -1
    check_tensor(req_rows, "req_rows", dim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor(prompt_lens, "prompt_lens", dim=1, dtypes=INDEX_DTYPES, shape=(R,), device=dev)
    check_tensor(slots, "slots", dim=1, dtypes=INDEX_DTYPES, shape=(R,), device=dev)
    check_tensor(weights, "weights", dim=2, dtypes=(torch.float32,), device=dev)
    num_layers = weights.shape[0]
    router = Router(
        weights, table, inv_freq=inv_freq, num_kv_heads=hkv, head_dim=d, block_size=bs,
        attention_scaling=attention_scaling, pool_tokens=pool_tokens, pooling=pooling, fa_value=fa_value,
        sa_value=sa_value, num_chunks=num_chunks, norm=norm, sa_margin=sa_margin,
    )  # fmt: skip
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer: {layer} out of range for {num_layers} router layers")
    if logits_out is not None:
        check_tensor(logits_out, "logits_out", dtypes=(torch.float32,), shape=(R, hkv, 2), device=dev)
        if not logits_out.is_contiguous():
            raise ValueError("logits_out: must be contiguous")
    if epilogue is not None:
        check_epilogue(epilogue, R, num_layers, hkv, dev)
    router(key_cache, block_table, req_rows, prompt_lens, slots, layer, logits_out, epilogue=epilogue)
    return table
