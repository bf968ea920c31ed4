"""Triton building blocks shared by the prefill and decode kernels.

``load_kv_tile`` reads one [BLOCK_N, D] tile of keys or values of one KV head from a vLLM-layout
paged cache; ``attn_step`` folds one key/value tile into the running online-softmax state
(log2 domain: scores are pre-multiplied by scale * log2(e), so exp2 is exact softmax).

Visibility inside a masked step, token exact (key j, query position i)::

    j <= i  and  (j < sink  or  i - j < window)  and  row_sel[i]

FA heads run with sink 0 and a window no sequence reaches (``BIG_WINDOW``), so one formula
covers FA and SSA; XA rows add ``row_sel`` (the query block the key block was selected for).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    p_cache,  # cache base + head offset
    p_bt,  # block_table row of the request
    k0,  # first key position of the tile
    seq_len,
    s_blk,
    s_tok,
    o_d,  # [BLOCK_D]
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    o_n = k0 + tl.arange(0, BLOCK_N)  # [BN] key positions
    if TILE_IN_BLOCK:
        # the whole tile lies in one physical block: one block-table read, affine addresses
        i_blk = tl.load(p_bt + k0 // BS).to(tl.int64)
        o_row = i_blk * s_blk + ((k0 % BS) + tl.arange(0, BLOCK_N)).to(tl.int64) * s_tok  # [BN]
    else:
        if MASKED:
            i_blk = tl.load(p_bt + o_n // BS, mask=o_n < seq_len, other=0).to(tl.int64)
        else:
            i_blk = tl.load(p_bt + o_n // BS).to(tl.int64)
        o_row = i_blk * s_blk + (o_n % BS).to(tl.int64) * s_tok  # [BN]
    p_t = p_cache + o_row[:, None] + o_d[None, :]  # [BN, BD]
    if MASKED:
        # positions past seq_len may hold anything (even NaN bit patterns): load zeros there
        m_t = (o_n < seq_len)[:, None]
        if BLOCK_D != HEAD_DIM:
            m_t = m_t & (o_d < HEAD_DIM)[None, :]
        b_t = tl.load(p_t, mask=m_t, other=0.0)
    else:
        if BLOCK_D != HEAD_DIM:
            b_t = tl.load(p_t, mask=(o_d < HEAD_DIM)[None, :], other=0.0)
        else:
            b_t = tl.load(p_t)
    return b_t, o_n


@triton.jit
def attn_step(
    acc,  # [BM, BD] fp32
    l_i,  # [BM] fp32
    m_i,  # [BM] fp32, log2 domain
    b_q,  # [BM, BD]
    p_k,
    p_v,
    p_bt,
    k0,
    q_pos,  # [BM] query positions (-1 for padding rows)
    row_sel,  # [BM] bool, only read when HAS_ROWSEL
    seq_len,
    eff_sink,
    eff_window,
    s_kb,
    s_kt,
    s_vb,
    s_vt,
    o_d,
    qk_scale,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_ROWSEL: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b_k, o_n = load_kv_tile(
        p_k, p_bt, k0, seq_len, s_kb, s_kt, o_d, BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, MASKED
    )  # [BN, BD]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BM, BN] raw scores
    if MASKED:
        i = q_pos[:, None]
        j = o_n[None, :]
        m_s = (j <= i) & ((j < eff_sink) | (i - j < eff_window))  # [BM, BN]
        if HAS_ROWSEL:
            m_s = m_s & row_sel[:, None]
        b_s = tl.where(m_s, b_s, float("-inf"))
    # the scale (> 0) commutes with max, so it folds into one FMA per score: s * scale - m
    m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)  # [BM]; m_i starts finite, so never -inf
    alpha = tl.exp2(m_i - m_new)
    b_p = tl.exp2(b_s * qk_scale - m_new[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    b_v, o_n = load_kv_tile(
        p_v, p_bt, k0, seq_len, s_vb, s_vt, o_d, BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, MASKED
    )  # [BN, BD]
    acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def softmax_pv(acc, l_i, m_i, b_s, p_v, p_bt, k0, seq_len, s_vb, s_vt, o_d, qk_scale,
               BS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               TILE_IN_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Online-softmax update with unmasked raw scores b_s [BM, BN] of the tile at k0, then P.V."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    b_p = tl.exp2(b_s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(b_p, 1)
    b_v, _o_n = load_kv_tile(
        p_v, p_bt, k0, seq_len, s_vb, s_vt, o_d, BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, False
    )
    acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def unmasked_loop_pipelined(acc, l_i, m_i, b_q, p_k, p_v, p_bt, lo, hi, seq_len, s_kb, s_kt, s_vb, s_vt, o_d,
                            qk_scale, BS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, TILE_IN_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Unmasked tiles [lo, hi) with S(j+1) = Q K(j+1)^T issued before the softmax of tile j.

    The two are independent, so an asynchronous tensor-core product can overlap the exp2/max work
    (FlashAttention-3's intra-warpgroup overlap, left to the compiler's async wgmma). Costs one more
    [BM, BN] fp32 score tile in registers.
    """
    if lo < hi:
        b_k, _o_n0 = load_kv_tile(
            p_k, p_bt, lo * BLOCK_N, seq_len, s_kb, s_kt, o_d, BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, False
        )
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BM, BN]
        for i_n in range(lo, hi - 1):
            b_k, _o_n = load_kv_tile(
                p_k, p_bt, (i_n + 1) * BLOCK_N, seq_len, s_kb, s_kt, o_d,
                BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, False,
            )  # fmt: skip
            b_s_next = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
            acc, l_i, m_i = softmax_pv(
                acc, l_i, m_i, b_s, p_v, p_bt, i_n * BLOCK_N, seq_len, s_vb, s_vt, o_d, qk_scale,
                BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, DOT_PREC,
            )  # fmt: skip
            b_s = b_s_next
        acc, l_i, m_i = softmax_pv(
            acc, l_i, m_i, b_s, p_v, p_bt, (hi - 1) * BLOCK_N, seq_len, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, DOT_PREC,
        )  # fmt: skip
    return acc, l_i, m_i
