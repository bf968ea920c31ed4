"""Triton building blocks shared by the prefill and decode kernels.

``kv_loop`` walks a run of key tiles of one KV head through a vLLM-layout paged cache and folds
each into the running online-softmax state (``attn_tile``; log2 domain: scores are pre-multiplied
by scale * log2(e), so exp2 is exact softmax). ``attn_step`` is the same step with its own
block-table lookup (the XA loop, whose tiles come from a list).

Why ``kv_loop`` fetches block ids one tile ahead: when a K/V address depends on a block-table load
made in the same iteration, Triton 3.6's software pipeliner puts that load in its own stage, issues
the K/V copies for tile i+1 at the END of iteration i and waits for them (``async_wait num=0``) at
the top of iteration i+1, so every tile pays the full memory latency (seen in the sm_90 TTGIR of
the first GPU version: 288 TFLOP/s where FlexAttention, same 128x64 tiles, ran at 436). With the
ids of tile i+1 loaded in iteration i and carried, the K/V loads no longer depend on a load of
their own iteration: the pipeliner keeps two tiles in flight (``num=2``, three buffers), as for a
contiguous cache.

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
def tile_blocks(p_bt, k0, seq_len, BS: tl.constexpr, BLOCK_N: tl.constexpr, TILE_IN_BLOCK: tl.constexpr):
    """Physical block ids of the key tile at k0: a scalar when the tile lies in one block, else one
    per key ([BLOCK_N]); 0 for keys at or past seq_len (never dereferenced unmasked)."""
    if TILE_IN_BLOCK:
        return tl.load(p_bt + k0 // BS, mask=k0 < seq_len, other=0)
    else:
        o_n = k0 + tl.arange(0, BLOCK_N)
        return tl.load(p_bt + o_n // BS, mask=o_n < seq_len, other=0)


@triton.jit
def load_tile_at(p_cache, blk, k0, seq_len, s_blk, s_tok, o_d,
                 BS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 TILE_IN_BLOCK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] keys or values at k0 given the tile's block ids (``tile_blocks``)."""
    o_n = k0 + tl.arange(0, BLOCK_N)
    if TILE_IN_BLOCK:
        o_row = blk.to(tl.int64) * s_blk + ((k0 % BS) + tl.arange(0, BLOCK_N)).to(tl.int64) * s_tok  # [BN]
    else:
        o_row = blk.to(tl.int64) * s_blk + (o_n % BS).to(tl.int64) * s_tok  # [BN]
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
    return b_t


@triton.jit
def attn_tile(acc, l_i, m_i, b_q, p_k, p_v, blk, k0, q_pos, seq_len, eff_sink, eff_window,
              s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
              BS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              TILE_IN_BLOCK: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """One key tile into the online softmax, given its block ids (``tile_blocks``); p_k/p_v: cache pointers,
    head offset included."""
    b_k = load_tile_at(p_k, blk, k0, seq_len, s_kb, s_kt, o_d, BS, BLOCK_N, HEAD_DIM, BLOCK_D,
                       TILE_IN_BLOCK, MASKED)  # fmt: skip
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BM, BN] raw scores
    if MASKED:
        i = q_pos[:, None]
        j = (k0 + tl.arange(0, BLOCK_N))[None, :]
        m_s = (j <= i) & ((j < eff_sink) | (i - j < eff_window))  # [BM, BN]
        b_s = tl.where(m_s, b_s, float("-inf"))
    # the scale (> 0) commutes with max, so it folds into one FMA per score: s * scale - m
    m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)  # [BM]; m_i starts finite, so never -inf
    alpha = tl.exp2(m_i - m_new)
    b_p = tl.exp2(b_s * qk_scale - m_new[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    b_v = load_tile_at(p_v, blk, k0, seq_len, s_vb, s_vt, o_d, BS, BLOCK_N, HEAD_DIM, BLOCK_D,
                       TILE_IN_BLOCK, MASKED)  # fmt: skip
    acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def kv_loop(acc, l_i, m_i, b_q, p_k, p_v, p_bt, v_lo, v_hi, s_hi, w_lo, q_pos, seq_len, eff_sink,
            eff_window, s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            TILE_IN_BLOCK: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Visible tiles v_lo..v_hi-1, tile v at key tile (v < s_hi ? v : w_lo + v - s_hi) (sink tiles,
    then window tiles); the block ids of tile v+1 are loaded during tile v (see module docstring)."""
    i_n = tl.where(v_lo < s_hi, v_lo, w_lo + v_lo - s_hi)
    blk = tile_blocks(p_bt, i_n * BLOCK_N, seq_len, BS, BLOCK_N, TILE_IN_BLOCK)
    for i_v in range(v_lo, v_hi):
        i_n = tl.where(i_v < s_hi, i_v, w_lo + i_v - s_hi)
        i_nx = tl.where(i_v + 1 < s_hi, i_v + 1, w_lo + i_v + 1 - s_hi)
        blk_cur = blk
        blk = tile_blocks(p_bt, i_nx * BLOCK_N, seq_len, BS, BLOCK_N, TILE_IN_BLOCK)
        acc, l_i, m_i = attn_tile(
            acc, l_i, m_i, b_q, p_k, p_v, blk_cur, i_n * BLOCK_N, q_pos, seq_len, eff_sink, eff_window,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, MASKED, DOT_PREC,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def long_first_head(p_md, s_hm1, num_kv_heads, i_l, t_cap, i0, BLOCK_H: tl.constexpr):
    """Program order of the prefill kernel: program i_l of a request's t_cap tiles x Hkv heads -> (KV head, rank
    i_g in its group, heads of the group). The long heads (FA, and XA: mode != 1) of every tile come first,
    heaviest tile first, the long heads of one tile adjacent; then the SSA heads the same way. Long programs of
    one wave then walk K/V in step and share it through L2; mixed in with short SSA programs (tile-major order,
    elastic_vllm/ops/README.md) they start staggered, walk different K/V tiles and, at 128K where one head's K/V (64 MB)
    outgrows L2, the hybrid turned HBM-bound (87.2 vs 74.4 ms at 128K, 75% SSA heads). Scalar loads in
    static loops over the BLOCK_H heads keep the head a uniform value (a tl.sum/cumsum over a head vector made it
    per-thread, and every K/V address derived from it: +8 / +26 spilled registers in the sm_90 build, 7% slower
    dense tiles). i0: any int32 scalar of the program (typed zero)."""
    n_long = i0 * 0
    for h in tl.static_range(BLOCK_H):
        md = tl.load(p_md + h * s_hm1, mask=h < num_kv_heads, other=1).to(tl.int32)
        n_long += (md != 1).to(tl.int32)
    in_long = i_l < n_long * t_cap
    n_grp = tl.maximum(tl.where(in_long, n_long, num_kv_heads - n_long), 1)
    i_g = tl.where(in_long, i_l, i_l - n_long * t_cap)
    rank = i_g % n_grp
    i_h = i0 * 0
    c_grp = i0 * 0
    for h in tl.static_range(BLOCK_H):
        md = tl.load(p_md + h * s_hm1, mask=h < num_kv_heads, other=1).to(tl.int32)
        in_grp = (h < num_kv_heads) & ((md != 1) == in_long)
        i_h = tl.where(in_grp & (c_grp == rank), h, i_h)
        c_grp += in_grp.to(tl.int32)
    return i_h, i_g, n_grp
