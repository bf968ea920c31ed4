"""The FA/SSA prefill kernel in the shape Triton's Hopper warp specialization accepts (``use_ws``, EXPERIMENTAL).

Status (H200, 2026-12-01): correct (benchmarks/ws/prefill_cases.py -> benchmarks/results/dev/ws-prefill-2-h200.json,
benchmarks/ws/prefill_bench.py -> dev/ws-prefill-bench-h200.json: within the float32 bound at 8K, <= 0.004 of the
pointer kernel everywhere) but SLOWER than the pointer kernel: 422-447 TFLOP/s vs 484-528 (0.80-0.88x) at 32K and
128K, dense and SA 0.75, with the one-compare mask (dev/ws-prefill-bench-2-h200.json; 0.64-0.72x with the first,
five-operation mask). The probe it was built from (benchmarks/ws/probe.py, non-causal, no mask) ran at 570 TFLOP/s:
the cost is the token mask, applied here to every tile because the pass accepts one key loop only (two
specialized loops in a row fail the pass too). Never chosen automatically; csrc/NOTES.md v5 has the whole story.

Triton 3.6 splits a ``tl.range(..., warp_specialize=True)`` loop on sm_90 into a TMA producer warp group and two
64-row consumer warp groups (Meta's autoWS, ``add_hopper_warpspec``): the softmax of one consumer overlaps the
other's GEMMs, the overlap FA3 gets by hand and the plain kernel (``prefill._prefill_kernel``) cannot have.
What the pass needs, found with offline sm_90 builds, and this kernel is written to:

- ONE key loop, the last loop of the program: every visible tile (sink tiles, then window tiles, the diagonal
  included) goes through it with the token-exact mask applied. A second loop after it, or a tile processed
  before it, broke the pass (``operation destroyed but still has uses`` / a failed pass).
- No ``scf.while`` anywhere (the request lookup is a fixed number of binary-search steps) and no early return.
- K/V tiles TMA loads of host tensor descriptors over 3-D [blocks, block_size, cols] views of the cache (column =
  head * head stride + d), so a key tile must lie inside one cache block (block_size % BLOCK_N == 0); Q through a
  device-side descriptor (with a host one the H200 build hung), the output through a per-request device-side one.
- One query head per program (BLOCK_M query tokens): the G heads of a KV head read the same K/V tiles through
  L2 instead of being packed into the rows (the packed Q tile, a reshape, broke the pass's data partitioning).
- No row vector computed from the Q descriptor's row coordinate: the pass adds the second consumer's 64-row
  offset to that scalar AND to the arange, i.e. twice (the offline TTGIR; wrong masks and a half-written output on
  the H200). Query positions come from ctx + tile offset, and the store is a TMA store (clipped at q_len).

Keys past seq_len: the tile that crosses seq_len is loaded shifted back so that it ENDS at seq_len; its first
rows are then earlier keys of the same block (masked as j < k0) or, before the block's start, rows the TMA unit
fills with zeros (negative coordinates). No row past seq_len is read, so the cache there may hold anything,
NaN bit patterns included (the same guarantee as the pointer kernel's masked loads).

XA heads (the block-list loop) are not handled here: launches with XA metadata use ``_prefill_kernel``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attn import long_first_head


@triton.jit
def _prefill_ws_kernel(
    q,  # [T, Hq, D], heads contiguous: read through a device-side [T, Hq * D] descriptor (a host one hung)
    k_desc,  # host descriptor: [num_blocks, block_size, cols] view of the key cache, box [1, BLOCK_N, D]
    v_desc,
    T,
    s_qt,
    o,
    block_table,
    query_start_loc,
    seq_lens,
    head_modes,
    head_mode_slots,
    s_ot,
    s_oh,
    s_kh,
    s_vh,
    s_bt,
    s_hm0,
    s_hm1,
    num_reqs,
    num_kv_heads,
    n_tiles,
    sink,
    window,
    qk_scale,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    FA_FIRST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    WS: tl.constexpr,
):
    i_p = tl.program_id(0)
    hq = num_kv_heads * G
    # query tiles of BLOCK_M tokens, request b owning tiles [query_start_loc[b] // BLOCK_M + b, ...), last first
    i_t = n_tiles - 1 - i_p // hq
    lo = i_t * 0
    hi = num_reqs - 1
    for _ in tl.static_range(SEARCH_STEPS):  # >= ceil(log2(num_reqs)) steps; once lo == hi, a step keeps it
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc + mid) // BLOCK_M + mid <= i_t
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    i_b = lo
    q_start = tl.load(query_start_loc + i_b)
    q_end = tl.load(query_start_loc + i_b + 1)
    q_len = q_end - q_start
    t_start = q_start // BLOCK_M + i_b
    t_cap = tl.where(i_b + 1 < num_reqs, q_end // BLOCK_M + i_b + 1, n_tiles) - t_start
    if HAS_SLOTS:
        i_row = tl.load(head_mode_slots + i_b).to(tl.int64)
    else:
        i_row = i_b.to(tl.int64)
    i_l = i_p - (n_tiles - t_start - t_cap) * hq  # rank of this program among its request's t_cap x Hq
    if FA_FIRST:  # the G programs (query heads) of a KV head adjacent: they read the same K/V tiles together
        i_h, i_g, n_grp = long_first_head(head_modes + i_row * s_hm0, s_hm1, num_kv_heads, i_l, t_cap, i_b, G,
                                          BLOCK_H)  # fmt: skip
        i_hq = i_h * G + i_g % G
        i_tl = t_cap - 1 - i_g // n_grp
    else:
        i_hq = i_p % hq
        i_h = i_hq // G
        i_tl = i_t - t_start
    seq_len = tl.load(seq_lens + i_b)
    ctx = seq_len - q_len
    mode = tl.load(head_modes + i_row * s_hm0 + i_h * s_hm1).to(tl.int32)
    is_ssa = mode == 1
    eff_sink = tl.where(is_ssa, sink, 0)
    eff_window = tl.where(is_ssa, window, 1 << 30)

    o_m = tl.arange(0, BLOCK_M)
    m_row = i_tl * BLOCK_M + o_m < q_len  # all False for the spare programs (i_tl * BLOCK_M >= q_len)
    q_pos = tl.where(m_row, ctx + i_tl * BLOCK_M + o_m, -1)
    q_lo = ctx + i_tl * BLOCK_M
    q_hi = tl.where(i_tl * BLOCK_M < q_len, tl.minimum(q_lo + BLOCK_M, seq_len) - 1, -1)
    # visible tiles: sink tiles [0, s_hi), then window tiles [w_lo, w_hi) (never revisiting a sink tile)
    s_hi = tl.cdiv(tl.minimum(eff_sink, q_hi + 1), BLOCK_N)
    w_lo = tl.maximum(s_hi, tl.maximum(q_lo - eff_window + 1, 0) // BLOCK_N)
    w_hi = tl.cdiv(q_hi + 1, BLOCK_N)
    n_vis = tl.maximum(s_hi + w_hi - w_lo, 0)

    q_desc = tl.make_tensor_descriptor(q, shape=[T, hq * HEAD_DIM], strides=[s_qt, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
    # rows of other requests or past T are finite (their queries) or zero (TMA bounds): masked at the store
    b_q = q_desc.load([q_start + i_tl * BLOCK_M, i_hq * HEAD_DIM])  # [BM, D]
    p_bt = block_table + i_b.to(tl.int64) * s_bt
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for i_v in tl.range(0, n_vis, warp_specialize=WS):
        i_n = tl.where(i_v < s_hi, i_v, w_lo + i_v - s_hi)
        k0 = i_n * BLOCK_N
        blk = tl.load(p_bt + k0 // BS)
        shift = tl.maximum(k0 + BLOCK_N - seq_len, 0)  # > 0 only for the tile crossing seq_len
        t0 = k0 % BS - shift
        b_k = k_desc.load([blk, t0, i_h * s_kh]).reshape(BLOCK_N, HEAD_DIM)
        b_s = tl.dot(b_q, b_k.T)  # [BM, BN] raw scores
        j = k0 - shift + tl.arange(0, BLOCK_N)  # key position of each loaded row
        # visible iff 0 <= q - j < limit_j, limit_j = window (2^31 - 1 for sink keys): one unsigned compare per
        # score. Rows loaded before k0 (the shifted tile) get j = 2^30 (q - j < 0); padding rows have q = -1
        j_c = tl.where(j >= k0, j, 1 << 30)
        lim = tl.where(j_c < eff_sink, 0x7FFFFFFF, eff_window).to(tl.uint32)
        diff = (q_pos[:, None] - j_c[None, :]).to(tl.uint32, bitcast=True)
        b_s = tl.where(diff < lim[None, :], b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)  # m_i starts finite: never -inf
        alpha = tl.exp2(m_i - m_new)
        b_p = tl.exp2(b_s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_v = v_desc.load([blk, t0, i_h * s_vh]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None])
        m_i = m_new
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    b_o = acc / l_i[:, None]
    # a TMA store through this request's own [q_len, Hq * D] view clips the rows past q_len. Not a pointer store:
    # the H200 build offset the second consumer's rows twice when row vectors shared the load coordinate's value
    # (benchmarks/ws/bisect.py), and a spare program (or an empty request) stores nowhere: its row is past the view
    o_desc = tl.make_tensor_descriptor(o + q_start.to(tl.int64) * s_ot, shape=[tl.maximum(q_len, 1), hq * HEAD_DIM],
                                       strides=[s_ot, 1], block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
    o_desc.store([tl.where(i_tl * BLOCK_M < q_len, i_tl * BLOCK_M, 1 << 30), i_hq * s_oh], b_o.to(o.dtype.element_ty))
