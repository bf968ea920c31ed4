"""Fused hybrid prefill attention over a paged KV cache: FA, SSA and XA heads in ONE launch.

Why one file of ~520 lines: one operator, as FLA keeps them: the kernel and its loop helpers, the per-device
config, and the host launcher that checks shapes, strides and dtypes (its reference: elastic_vllm/reference/).

Each program owns one (query tile, KV head) of one request. A query tile packs the G = Hq / Hkv
query heads of the KV head into the M dimension (BLOCK_M rows = BLOCK_Q tokens x G heads), so
K/V are read once per group and never expanded. The head's mode is read from device metadata,
and the program visits only the key tiles its mode needs::

    FA  (mode 0): every causal tile           keys ->  x x x x x x x x x
    SSA (mode 1): sink tiles + window tiles             x x . . . . x x x
    XA  (mode 2): the selected key blocks               x . . x . x . x x

Tiles fully inside the visible region run without a mask; the few boundary tiles (diagonal,
window edge, sink edge) apply the token-exact mask. SSA programs therefore finish after
~(sink + window) / BLOCK_N tiles. Inside each request the long programs (FA, XA heads) are
launched first, heaviest query tile first, then the SSA programs fill the tail; so the long
programs start in waves that walk K/V in step (shared through L2) instead of staggered.

With ``skip_fa`` the FA programs return at once: the vLLM backend runs long prompts' FA heads on vLLM's
FlashAttention 3 (its tiles run at ~1.24x this kernel's rate on the H200: 13.3 vs 16.6 ms, 32K dense,
``benchmarks/results/kernels-prefill-fa3-h200.json``) and this kernel only their SSA / XA heads.

XA metadata (see ``xattn_select``): for request b, KV head h and query block A (absolute
block = position // xattn_block) the selected key blocks are::

    xa_block_idx[b, h, A - first_qblock(b), :xa_block_cnt[b, h, A - first_qblock(b)]]

ascending absolute key-block indices, none above A (causal), first_qblock(b) = (seq_len - q_len) //
xattn_block. A query tile may straddle two query blocks (chunked prefill at any offset); it then runs both
lists, each with its own rows enabled.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from elastic_vllm.ops._attn import attn_step, attn_tile, kv_loop, long_first_head, tile_blocks
from elastic_vllm.ops._common import (
    check_paged_batch,
    check_ssa,
    check_tensor,
    dot_precision,
    interpret,
    next_pow2,
    prev_pow2,
)


@triton.jit
def _window_loops(
    acc,
    l_i,
    m_i,
    b_q,
    p_k,
    p_v,
    p_bt,
    q_pos,
    q_lo,
    q_hi,
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
    DOT_PREC: tl.constexpr,
):
    """FA and SSA: sink tiles + window tiles for queries at positions q_lo..q_hi."""
    # sink tiles [0, s_hi); window tiles [w_lo, w_hi), never revisiting a sink tile
    s_hi = tl.cdiv(tl.minimum(eff_sink, q_hi + 1), BLOCK_N)
    w_lo = tl.maximum(s_hi, tl.maximum(q_lo - eff_window + 1, 0) // BLOCK_N)
    w_hi = tl.cdiv(q_hi + 1, BLOCK_N)
    # window tiles visible to every row (k0 >= q_hi - window + 1 and k0 + BLOCK_N - 1 <= q_lo): no mask
    f_lo = tl.cdiv(tl.maximum(q_hi - eff_window + 1, 0), BLOCK_N)
    f_hi = (q_lo + 1) // BLOCK_N
    u_lo = tl.minimum(tl.maximum(f_lo, w_lo), w_hi)
    u_hi = tl.maximum(tl.minimum(f_hi, w_hi), u_lo)
    # 2) unmasked interior (the bulk of an FA head's work)
    acc, l_i, m_i = kv_loop(
        acc, l_i, m_i, b_q, p_k, p_v, p_bt, u_lo, u_hi, 0, 0, q_pos, seq_len, eff_sink, eff_window,
        s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
        BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, False, DOT_PREC,
    )  # fmt: skip
    # 1) masked: sink tiles, then the window's leading edge [w_lo, u_lo)
    acc, l_i, m_i = kv_loop(
        acc, l_i, m_i, b_q, p_k, p_v, p_bt, 0, s_hi + (u_lo - w_lo), s_hi, w_lo, q_pos, seq_len, eff_sink,
        eff_window, s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
        BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, True, DOT_PREC,
    )  # fmt: skip
    # 3) masked: the diagonal tiles
    acc, l_i, m_i = kv_loop(
        acc, l_i, m_i, b_q, p_k, p_v, p_bt, u_hi, w_hi, 0, 0, q_pos, seq_len, eff_sink, eff_window,
        s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
        BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, True, DOT_PREC,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _xa_loop(
    acc,
    l_i,
    m_i,
    b_q,
    p_k,
    p_v,
    p_bt,
    q_pos,
    q_lo,
    q_hi,
    ctx,
    seq_len,
    p_xi,  # xa_block_idx[b, h]
    p_xc,  # xa_block_cnt[b, h]
    s_xi2,
    is_xa,  # False: an empty list (a FA/SSA head of a launch with XA metadata)
    s_kb,
    s_kt,
    s_vb,
    s_vt,
    o_d,
    qk_scale,
    XA_BLOCK: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """XA: the selected key blocks of the (at most two) query blocks this tile touches.

    A tile inside one query block A (always, when the chunk starts on a 32-token boundary) takes the fast
    path: the blocks of A's list below A (every key visible to every row) unmasked, their list entries and
    block ids fetched two and one tiles ahead (the address of a tile's K/V never waits on a load of its own
    iteration, see _attn's docstring: a loop of list -> block table -> K/V in one iteration,
    ran 1.8x slower per tile than the FA heads), then the diagonal block A masked. A tile across two query
    blocks runs every listed tile masked, rows filtered by their block. Straight-line: the paths are loops
    whose trip counts are 0 when not taken (no if/else merging acc, see the caller)."""
    SUB: tl.constexpr = XA_BLOCK // BLOCK_N
    base = ctx // XA_BLOCK
    a1 = q_lo // XA_BLOCK
    a2 = q_hi // XA_BLOCK
    two = a2 != a1
    n1 = tl.load(p_xc + (a1 - base), mask=is_xa, other=0)
    n2 = tl.load(p_xc + (a2 - base), mask=is_xa & two, other=0)
    p_l1 = p_xi + (a1 - base).to(tl.int64) * s_xi2
    p_l2 = p_xi + (a2 - base).to(tl.int64) * s_xi2
    # fast path, 1) A's blocks below A: tiles 0 .. n_fast-1 (entry t // SUB, sub-tile t % SUB); the list is
    # ascending and causal, so only its last entry can be A itself (xattn_select always keeps it)
    c_last = tl.load(p_l1 + tl.maximum(n1 - 1, 0), mask=n1 > 0, other=-1)
    has_diag = (n1 > 0) & (c_last == a1)
    n_fast = tl.where(two, 0, (n1 - has_diag.to(tl.int32)) * SUB)
    c0 = tl.load(p_l1, mask=n_fast > 0, other=0)
    k_nx = c0 * XA_BLOCK
    blk_nx = tile_blocks(p_bt, k_nx, seq_len, BS, BLOCK_N, TILE_IN_BLOCK)
    c_nx2 = tl.load(p_l1 + 1 // SUB, mask=1 < n_fast, other=0)  # the list entry of tile 1
    for i_v in range(0, n_fast):
        k_cur = k_nx
        blk_cur = blk_nx
        k_nx = c_nx2 * XA_BLOCK + ((i_v + 1) % SUB) * BLOCK_N
        blk_nx = tile_blocks(p_bt, k_nx, seq_len, BS, BLOCK_N, TILE_IN_BLOCK)
        c_nx2 = tl.load(p_l1 + (i_v + 2) // SUB, mask=i_v + 2 < n_fast, other=0)
        acc, l_i, m_i = attn_tile(
            acc, l_i, m_i, b_q, p_k, p_v, blk_cur, k_cur, q_pos, seq_len, 0, 1 << 30,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, False, DOT_PREC,
        )  # fmt: skip
    # fast path, 2) the diagonal block A when listed, causal
    n_diag = tl.where(two, 0, tl.where(has_diag, SUB, 0))
    for i_s in range(0, n_diag):
        k0 = a1 * XA_BLOCK + i_s * BLOCK_N
        blk = tile_blocks(p_bt, k0, seq_len, BS, BLOCK_N, TILE_IN_BLOCK)
        acc, l_i, m_i = attn_tile(
            acc, l_i, m_i, b_q, p_k, p_v, blk, k0, q_pos, seq_len, 0, 1 << 30,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, True, DOT_PREC,
        )  # fmt: skip
    # a tile across two query blocks: every listed tile masked, rows filtered by their query block
    row_qb = q_pos // XA_BLOCK  # [BM]
    n_two = tl.where(two, (n1 + n2) * SUB, 0)
    for i_v in range(0, n_two):
        i_j = i_v // SUB
        first = i_j < n1
        c1 = tl.load(p_l1 + i_j, mask=first, other=0)
        c2 = tl.load(p_l2 + (i_j - n1), mask=i_j >= n1, other=0)
        i_c = tl.where(first, c1, c2)
        a = tl.where(first, a1, a2)
        k0 = i_c * XA_BLOCK + (i_v % SUB) * BLOCK_N
        acc, l_i, m_i = attn_step(
            acc, l_i, m_i, b_q, p_k, p_v, p_bt, k0, q_pos, row_qb == a, seq_len, 0, 1 << 30,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, True, True, DOT_PREC,
        )  # fmt: skip
    return acc, l_i, m_i


# Compiled once per engine configuration: the ints and row pointers that vary between steps are not specialised
# (Triton compiles a variant per divisibility-by-16 / 16-byte-alignment pattern, each a stall of seconds the first
# time it shows up in the engine). A step's prefill rows start after its decode rows, so seq_lens / block_table /
# head_modes arrive offset by num_decodes elements (16-byte alignment comes and goes) and num_reqs takes any
# value. xa_idx / xa_cnt receive that same block-table slice when the step has no XA heads. The block table's row
# stride follows max_model_len, so the warm-up's synthetic batch would otherwise compile another variant than the
# engine's. tests/vllm_cpu/test_warmup_variants.py checks every serving launch against the warm-up's keys. The q / o / cache strides
# are (multiples of 16 in the engine and the warm-up alike, head sizes being multiples of 16): that is what
# makes the K / V tile copies 16-byte cp.async (144 LDGSTS.128 in the sm_90 build); without it they were
# 448 2-byte loads and the H200's 8K prefills took 1.56x longer.
@triton.jit(
    do_not_specialize=[
        "n_tiles",
        "num_reqs",
        "s_bt",
        "s_hm0",
        "s_xi0",
        "s_xi1",
        "s_xi2",
        "s_xc0",
        "s_xc1",
    ],
    do_not_specialize_on_alignment=[
        "block_table",
        "query_start_loc",
        "seq_lens",
        "head_modes",
        "head_mode_slots",
        "xa_idx",
        "xa_cnt",
    ],
)
def _prefill_kernel(
    q,
    k_cache,
    v_cache,
    o,
    block_table,
    query_start_loc,
    seq_lens,
    head_modes,
    head_mode_slots,
    xa_idx,
    xa_cnt,
    s_qt,
    s_qh,
    s_ot,
    s_oh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    s_bt,
    s_hm0,
    s_hm1,
    s_xi0,
    s_xi1,
    s_xi2,
    s_xc0,
    s_xc1,
    num_reqs,
    num_kv_heads,
    n_tiles,
    sink,
    window,
    qk_scale,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_XA: tl.constexpr,
    XA_BLOCK: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SKIP_FA: tl.constexpr,
):
    i_p = tl.program_id(0)
    # requests in reverse order of their tile ranges (request b owns query tiles [start_b, start_{b+1}),
    # start_b = query_start_loc[b] // BLOCK_Q + b); i_t is any tile of the request this program falls in
    i_t = n_tiles - 1 - i_p // num_kv_heads
    # request of this tile: the largest b with query_start_loc[b] // BLOCK_Q + b <= i_t
    lo = i_t * 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        ok = start <= i_t
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    i_b = lo
    q_start = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_start
    t_start = q_start // BLOCK_Q + i_b
    t_cap = tl.where(i_b + 1 < num_reqs, tl.load(query_start_loc + i_b + 1) // BLOCK_Q + i_b + 1, n_tiles) - t_start
    if HAS_SLOTS:
        i_row = tl.load(head_mode_slots + i_b).to(tl.int64)
    else:
        i_row = i_b.to(tl.int64)
    # rank of this program inside its request's t_cap x Hkv programs
    i_l = i_p - (n_tiles - t_start - t_cap) * num_kv_heads
    i_h, i_g, n_grp = long_first_head(head_modes + i_row * s_hm0, s_hm1, num_kv_heads, i_l, t_cap, i_b, BLOCK_H)
    i_tl = t_cap - 1 - i_g // n_grp  # tile index inside the request
    if i_tl * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + i_b)
    ctx = seq_len - q_len  # positions of this step's queries: ctx .. seq_len-1
    mode = tl.load(head_modes + i_row * s_hm0 + i_h * s_hm1).to(tl.int32)
    if SKIP_FA:
        if mode == 0:  # written by vLLM's FlashAttention (``skip_fa``)
            return

    o_m = tl.arange(0, BLOCK_M)
    o_tok = i_tl * BLOCK_Q + o_m // G  # [BM] query index inside the request
    o_hq = i_h * G + o_m % G  # [BM] query head
    m_row = (o_m < BLOCK_Q * G) & (o_tok < q_len)
    q_pos = tl.where(m_row, ctx + o_tok, -1)  # [BM]
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_qrow = (q_start + o_tok).to(tl.int64)
    p_q = q + o_qrow[:, None] * s_qt + (o_hq * s_qh)[:, None] + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    q_lo = ctx + i_tl * BLOCK_Q
    q_hi = tl.minimum(q_lo + BLOCK_Q, seq_len) - 1

    p_k = k_cache + i_h.to(tl.int64) * s_kh
    p_v = v_cache + i_h.to(tl.int64) * s_vh
    p_bt = block_table + i_b.to(tl.int64) * s_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    # FA = SSA with no sink and an unreachable window; XA without metadata runs as FA
    is_ssa = mode == 1
    eff_sink = tl.where(is_ssa, sink, 0)
    eff_window = tl.where(is_ssa, window, 1 << 30)
    if HAS_XA:
        # straight-line, no if/else on the mode: an XA head's window loops are empty (q_hi = -1) and a
        # FA/SSA head's XA list is empty. (An if/else merging acc from the two paths made ptxas
        # serialize every wgmma of the kernel, warning C7515, in the sm_90 build.)
        is_xa = mode == 2
        acc, l_i, m_i = _window_loops(
            acc, l_i, m_i, b_q, p_k, p_v, p_bt, q_pos, q_lo, tl.where(is_xa, -1, q_hi), seq_len,
            eff_sink, eff_window, s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, DOT_PREC,
        )  # fmt: skip
        p_xi = xa_idx + i_b.to(tl.int64) * s_xi0 + i_h.to(tl.int64) * s_xi1
        p_xc = xa_cnt + i_b.to(tl.int64) * s_xc0 + i_h.to(tl.int64) * s_xc1
        acc, l_i, m_i = _xa_loop(
            acc, l_i, m_i, b_q, p_k, p_v, p_bt, q_pos, q_lo, q_hi, ctx, seq_len, p_xi, p_xc, s_xi2, is_xa,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            XA_BLOCK, BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, DOT_PREC,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _window_loops(
            acc, l_i, m_i, b_q, p_k, p_v, p_bt, q_pos, q_lo, q_hi, seq_len, eff_sink, eff_window,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, DOT_PREC,
        )  # fmt: skip
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    b_o = acc / l_i[:, None]
    p_o = o + o_qrow[:, None] * s_ot + (o_hq * s_oh)[:, None] + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


def default_prefill_config(head_dim: int, group: int, dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """A copy of the tile sizes of ``_default_prefill_config``, cached per argument set: the launcher asks once
    per layer and step, and the cache spares it an environment read and (on CUDA) a capability query each time."""
    return dict(_default_prefill_config(head_dim, group, dtype, device, interpret()))


@functools.lru_cache(maxsize=64)
def _default_prefill_config(head_dim: int, group: int, dtype: torch.dtype, device, interp: bool) -> dict:
    """Tile sizes. Hopper+ (>= 227 KB of shared memory per block), 16-bit, d <= 128: 128-row query
    tiles x 128-key tiles, 8 warps (two warpgroups of 64 rows), 3 stages = three K/V buffers:
    224 KB at d 128 (H200, first run: 128-key tiles 350 TFLOP/s vs 290 with 64-key tiles, both
    before the pipelining fix). Other GPUs and fp32 (a checking path): tiles that fit ~128 KB."""
    if interp:
        # the interpreter's cost is per program and per op: big tiles, few programs
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 1}
    big_smem = device is None or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
    if dtype == torch.float32:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}
    if head_dim <= 64:
        return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if head_dim <= 128:
        return {"block_m": 128, "block_n": 128 if big_smem else 64, "num_warps": 8, "num_stages": 3}
    return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    head_modes: torch.Tensor,
    *,
    sink: int,
    window: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    head_mode_slots: torch.Tensor | None = None,
    xa_block_idx: torch.Tensor | None = None,
    xa_block_cnt: torch.Tensor | None = None,
    xattn_block: int = 128,
    skip_fa: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Hybrid FA/SSA/XA causal attention for a varlen batch over a paged KV cache (one launch).

    Args:
        q: [T, Hq, D] packed queries; request b owns rows query_start_loc[b]:query_start_loc[b+1],
            its LAST q_len tokens (positions seq_len-q_len .. seq_len-1; any q_len >= 0).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (any strides, D contiguous).
        block_table: [B, max_blocks] int32 block ids of each request.
        query_start_loc: [B+1] int32. seq_lens: [B] int32 tokens in the cache, this step's included.
        head_modes: [B, Hkv] int (HeadMode: 0 FA, 1 SSA, 2 XA); with ``head_mode_slots`` [B] int32
            it is instead a [slots, Hkv] table (e.g. ``routing_table[:, layer]``) read at row
            head_mode_slots[b].
        sink, window: SSA visibility, token exact: key j visible to query i iff
            j <= i and (j < sink or i - j < window).
        xa_block_idx: [B, Hkv, max_q_blocks, max_k_blocks] int32 and xa_block_cnt
            [B, Hkv, max_q_blocks] int32, the XA selection (format in the module docstring,
            produced by ``xattn_select``). Without them, XA heads run as FA.
        skip_fa: leave the output of FA heads (mode 0) unwritten: another kernel computes them
            (``elastic_vllm.vllm_plugin.ops``: vLLM's FlashAttention, one call per KV head).
        out: optional [T, Hq, D] output (written in place).
        block_m, block_n, num_warps, num_stages: tuning overrides.

    Returns:
        out [T, Hq, D] in q's dtype. No host synchronisation.
    """
    B, hq, hkv, d, bs = check_paged_batch(
        q, key_cache, value_cache, seq_lens, block_table, head_modes, head_mode_slots, query_start_loc
    )
    dev, T = q.device, q.shape[0]
    check_ssa(sink, window)
    has_xa = xa_block_idx is not None or xa_block_cnt is not None
    if has_xa:
        if xa_block_idx is None or xa_block_cnt is None:
            raise ValueError("xa_block_idx/xa_block_cnt: pass both or neither")
        check_tensor(xa_block_idx, "xa_block_idx", dim=4, dtypes=(torch.int32,), shape=(B, hkv), device=dev)
        check_tensor(
            xa_block_cnt,
            "xa_block_cnt",
            dim=3,
            dtypes=(torch.int32,),
            shape=(B, hkv, xa_block_idx.shape[2]),
            device=dev,
        )
        if xattn_block % 16:
            raise ValueError(f"xattn_block: must be a multiple of 16, got {xattn_block}")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor(out, "out", dim=3, dtypes=(q.dtype,), shape=tuple(q.shape), device=dev, last_contiguous=True)
    if T == 0 or B == 0:
        return out

    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    cfg = default_prefill_config(d, g, q.dtype, dev)
    bm = block_m or cfg["block_m"]
    bn = block_n or cfg["block_n"]
    bm = max(bm, next_pow2(g), 16)
    if has_xa:
        # a query tile must not span more than two XA query blocks, and key tiles must tile a block
        bm = max(min(bm, prev_pow2(xattn_block * g)), 16)
        bn = math.gcd(bn, xattn_block & -xattn_block)
    if bn < 16 or bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"block_m/block_n: powers of two >= 16 required, got {bm}/{bn}")
    block_q = bm // g
    if has_xa and block_q > xattn_block:
        raise ValueError(f"block_m: query tile of {block_q} tokens exceeds xattn_block {xattn_block}")
    n_tiles = triton.cdiv(T, block_q) + B  # >= sum_b cdiv(q_len_b, block_q); extra programs exit
    grid = (n_tiles * hkv,)
    hm_slots = head_mode_slots if head_mode_slots is not None else seq_lens
    xi = xa_block_idx if has_xa else block_table
    xc = xa_block_cnt if has_xa else block_table
    xis = xa_block_idx.stride()[:3] if has_xa else (0, 0, 0)
    xcs = xa_block_cnt.stride()[:2] if has_xa else (0, 0)
    ks, vs = key_cache.stride(), value_cache.stride()
    args = (
        q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens, head_modes, hm_slots, xi, xc,
        *q.stride()[:2], *out.stride()[:2], *ks[:3], *vs[:3], block_table.stride(0), *head_modes.stride(),
        xis[0], xis[1], xis[2], xcs[0], xcs[1],
        B, hkv, n_tiles, sink, window, scale * 1.4426950408889634,
    )  # fmt: skip
    meta = dict(
        G=g, BLOCK_Q=block_q, BLOCK_M=bm, BLOCK_N=bn, BS=bs, HEAD_DIM=d, BLOCK_D=max(next_pow2(d), 16),
        TILE_IN_BLOCK=bs % bn == 0, HAS_SLOTS=head_mode_slots is not None, HAS_XA=has_xa,
        XA_BLOCK=xattn_block, DOT_PREC=dot_precision(q.dtype),
        BLOCK_H=max(next_pow2(hkv), 2), SKIP_FA=skip_fa,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )  # fmt: skip
    _prefill_kernel[grid](*args, **meta)
    return out
