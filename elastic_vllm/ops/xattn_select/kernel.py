"""XAttention block selection on the GPU: antidiagonal scoring + threshold, per (request, KV head).

Same semantics as ``elastic_vllm.ops.xattn_select.naive.xattn_block_mask_ref`` (read its docstring):
strided antidiagonal estimates over absolute stride groups, group-level causal softmax (float32),
block mass summed over the live query groups and the G query heads of the KV head, then per
query block the smallest set of key blocks (largest mass first, ties to the lower index) whose
mass reaches ``threshold`` of the row total, plus block 0 and the diagonal block.

One program per (query block, KV head, request); programs of heads not in XA mode write a zero
count and exit, so FA/SSA heads cost nothing (and a caller in FA-SSA mode does not launch this).
A program computes the [query groups x key groups] estimates tile by tile twice (row max/sum,
then normalised block masses), keeps the block masses of its row in a small global scratch, and
selects without a sort: a bisection over the masses' bit patterns finds the smallest kept mass, so no
tile is sized by the sequence and one compiled kernel serves every length (a bitonic sort over the
next power of two of the key blocks, compiled once per power of two: the first
request of each new length range stalled by it in the engine, 1.3-4.5 s in e2e-vllm-h200-demo.json).

Output (the prefill kernel's XA metadata)::

    xa_block_idx [B, Hkv, max_q_blocks, max_k_blocks] int32   ascending absolute key blocks
    xa_block_cnt [B, Hkv, max_q_blocks] int32                 how many are valid

indexed by the query block RELATIVE to the request's first query block of this step
((seq_len - q_len) // block). Rows of query blocks the request does not have get count 0.

Agreement with the reference: identical selections on random inputs except where a block's
cumulative mass lies within float32 rounding (~1e-4 relative) of the threshold, since the
estimates and sums are accumulated in a different order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastic_vllm.ops._common import (
    check_paged_batch,
    dot_precision,
    next_pow2,
)


@triton.jit
def _est_tile(
    q,
    k_cache,
    p_bt,
    grp,  # [BR] query group of each row
    o_hq,  # [BR] query head of each row
    q_start,
    ctx,
    seq_len,
    c0,
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    qk_scale,
    STRIDE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """est[r, c] = sum_s q[grp_r*S + S-1-s] . k[(c0+c)*S + s] * scale / S * log2(e)."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_c = c0 + tl.arange(0, BLOCK_C)  # [BC] key groups
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for s in range(STRIDE):
        qpos = grp * STRIDE + (STRIDE - 1 - s)  # [BR]
        m_q = (qpos >= ctx) & (qpos < seq_len)  # queries outside this step count as zero
        o_tok = (q_start + qpos - ctx).to(tl.int64)
        b_q = tl.load(
            q + o_tok[:, None] * s_qt + (o_hq * s_qh)[:, None] + o_d[None, :],
            mask=m_q[:, None] & m_d[None, :],
            other=0.0,
        )  # [BR, BD]
        kpos = o_c * STRIDE + s  # [BC]
        m_k = kpos < seq_len
        i_blk = tl.load(p_bt + kpos // BS, mask=m_k, other=0).to(tl.int64)
        b_k = tl.load(
            k_cache + (i_blk * s_kb + (kpos % BS) * s_kt)[:, None] + o_d[None, :],
            mask=m_k[:, None] & m_d[None, :],
            other=0.0,
        )  # [BC, BD]
        acc += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    return acc * qk_scale


@triton.jit(
    do_not_specialize=[  # q / cache strides specialised: 16-byte loads (elastic_vllm/ops/prefill/kernel.py)
        "s_bt",
        "s_hm0",
        "s_xi0",
        "s_xi1",
        "s_xi2",
        "s_xc0",
        "s_xc1",
        "s_mass",
    ],
    do_not_specialize_on_alignment=["block_table", "query_start_loc", "seq_lens", "head_modes", "head_mode_slots"],
)
def _xattn_select_kernel(
    q,
    k_cache,
    block_table,
    query_start_loc,
    seq_lens,
    head_modes,
    head_mode_slots,
    xa_idx,
    xa_cnt,
    mass,  # fp32 [B, Hkv, max_q_blocks, s_mass] scratch
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_bt,
    s_hm0,
    s_hm1,
    s_xi0,
    s_xi1,
    s_xi2,
    s_xc0,
    s_xc1,
    s_mass,
    threshold,
    qk_scale,
    G: tl.constexpr,
    STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    PER: tl.constexpr,
    KPT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEL_T: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    BLOCK_C: tl.constexpr = PER * KPT
    i_a = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    p_cnt = xa_cnt + i_b.to(tl.int64) * s_xc0 + i_h * s_xc1 + i_a
    if HAS_SLOTS:
        i_row = tl.load(head_mode_slots + i_b).to(tl.int64)
    else:
        i_row = i_b.to(tl.int64)
    mode = tl.load(head_modes + i_row * s_hm0 + i_h * s_hm1).to(tl.int32)
    q_start = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_start
    seq_len = tl.load(seq_lens + i_b)
    ctx = seq_len - q_len
    blk_a = ctx // BLOCK + i_a  # absolute query block
    if (mode != 2) | (q_len <= 0) | (blk_a * BLOCK >= seq_len):
        tl.store(p_cnt, 0)
        return
    g_lo = ctx // STRIDE
    g_hi = (seq_len - 1) // STRIDE
    o_r = tl.arange(0, BLOCK_R)
    grp = blk_a * PER + o_r // G  # [BR]
    o_hq = i_h * G + o_r % G
    row_live = (o_r < PER * G) & (grp >= g_lo) & (grp <= g_hi)
    grp = tl.where(o_r < PER * G, grp, blk_a * PER)
    a_max = tl.minimum(blk_a * PER + PER - 1, g_hi)
    n_ct = tl.cdiv(a_max + 1, BLOCK_C)
    p_bt = block_table + i_b.to(tl.int64) * s_bt
    p_k = k_cache + i_h.to(tl.int64) * s_kh
    # pass 1: row max / sum of the group-causal softmax
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    for i_ct in range(0, n_ct):
        c0 = i_ct * BLOCK_C
        b_e = _est_tile(
            q, p_k, p_bt, grp, o_hq, q_start, ctx, seq_len, c0, s_qt, s_qh, s_kb, s_kt, qk_scale,
            STRIDE, BS, BLOCK_R, BLOCK_C, HEAD_DIM, BLOCK_D, DOT_PREC,
        )  # fmt: skip
        o_c = c0 + tl.arange(0, BLOCK_C)
        b_e = tl.where(o_c[None, :] <= grp[:, None], b_e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_e, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(b_e - m_new[:, None]), 1)
        m_i = m_new
    r_l = tl.where(row_live, 1.0 / l_i, 0.0)  # dead rows carry no mass
    # pass 2: normalised probabilities summed into key-block masses
    p_mass = mass + ((i_b.to(tl.int64) * tl.num_programs(1) + i_h) * tl.num_programs(0) + i_a) * s_mass
    for i_ct in range(0, n_ct):
        c0 = i_ct * BLOCK_C
        b_e = _est_tile(
            q, p_k, p_bt, grp, o_hq, q_start, ctx, seq_len, c0, s_qt, s_qh, s_kb, s_kt, qk_scale,
            STRIDE, BS, BLOCK_R, BLOCK_C, HEAD_DIM, BLOCK_D, DOT_PREC,
        )  # fmt: skip
        o_c = c0 + tl.arange(0, BLOCK_C)
        b_p = tl.where(o_c[None, :] <= grp[:, None], tl.exp2(b_e - m_i[:, None]), 0.0) * r_l[:, None]
        b_col = tl.sum(b_p, 0)  # [BC]
        b_blk = tl.sum(tl.reshape(b_col, [KPT, PER]), 1)  # [KPT]
        o_kb = i_ct * KPT + tl.arange(0, KPT)
        tl.store(p_mass + o_kb, b_blk, mask=o_kb <= blk_a)
    tl.debug_barrier()
    # selection: the reference sorts (mass desc, index asc) and keeps the prefix whose preceding mass is
    # < threshold * total. The same set without a sort, so that nothing here is sized by the sequence
    # (one compiled kernel for every length): v = the largest mass (as its bit pattern; masses >= 0, so bit
    # order = value order) with sum(mass >= v) >= need, found by bisection over the bits; every block above v
    # is kept, and of the blocks equal to v those (in index order, rank j) with sum(mass > v) + j * v < need,
    # the first always (the last kept block of the sorted prefix has mass v).
    n_kb = blk_a + 1
    o_t = tl.arange(0, SEL_T)
    total = 0.0
    hi_v = i_a * 0
    for t0 in range(0, n_kb, SEL_T):
        b_m = tl.load(p_mass + t0 + o_t, mask=t0 + o_t < n_kb, other=0.0)
        total += tl.sum(b_m, 0)
        hi_v = tl.maximum(hi_v, tl.max(b_m.to(tl.int32, bitcast=True), 0))
    need = threshold * total
    lo_v = i_a * 0  # invariant: sum(mass >= lo_v) >= need (lo_v = 0: the total)
    while lo_v < hi_v:
        mid = lo_v + (hi_v - lo_v + 1) // 2
        s_ge = 0.0
        for t0 in range(0, n_kb, SEL_T):
            b_m = tl.load(p_mass + t0 + o_t, mask=t0 + o_t < n_kb, other=0.0)
            s_ge += tl.sum(tl.where(b_m.to(tl.int32, bitcast=True) >= mid, b_m, 0.0), 0)
        ok = s_ge >= need
        lo_v = tl.where(ok, mid, lo_v)
        hi_v = tl.where(ok, hi_v, mid - 1)
    v_f = lo_v.to(tl.float32, bitcast=True)
    s_gt = 0.0
    for t0 in range(0, n_kb, SEL_T):
        b_m = tl.load(p_mass + t0 + o_t, mask=t0 + o_t < n_kb, other=0.0)
        s_gt += tl.sum(tl.where(b_m.to(tl.int32, bitcast=True) > lo_v, b_m, 0.0), 0)
    p_idx = xa_idx + i_b.to(tl.int64) * s_xi0 + i_h * s_xi1 + i_a.to(tl.int64) * s_xi2
    n_sel = i_a * 0
    n_eq = i_a * 0
    for t0 in range(0, n_kb, SEL_T):
        o_kb = t0 + o_t
        m_kb = o_kb < n_kb
        bits = tl.load(p_mass + o_kb, mask=m_kb, other=0.0).to(tl.int32, bitcast=True)
        eq = m_kb & (bits == lo_v)
        rank = n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        keep_eq = eq & ((rank == 0) | (s_gt + rank.to(tl.float32) * v_f < need))
        sel = m_kb & ((bits > lo_v) | keep_eq | (o_kb == 0) | (o_kb == blk_a))
        pos = n_sel + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(p_idx + pos, o_kb, mask=sel)
        n_sel += tl.sum(sel.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)
    tl.store(p_cnt, n_sel)


def xattn_max_blocks(max_query_len: int, max_seq_len: int, block: int = 128) -> tuple[int, int]:
    """(max_q_blocks, max_k_blocks) for a batch: a chunk may start mid-block, hence the +1."""
    return triton.cdiv(max_query_len, block) + 1, max(triton.cdiv(max_seq_len, block), 1)


def xattn_select(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    head_modes: torch.Tensor,
    *,
    max_q_blocks: int,
    max_k_blocks: int,
    stride: int = 16,
    block: int = 128,
    threshold: float = 0.9,
    scale: float | None = None,
    head_mode_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the key blocks of every XA (request, KV head, query block) of a varlen batch.

    Args:
        q: [T, Hq, D] this step's queries (as the attention sees them, post-RoPE), packed as for
            ``prefill_attention``; key_cache [num_blocks, block_size, Hkv, D].
        block_table, query_start_loc, seq_lens, head_modes, head_mode_slots: as ``prefill_attention``.
        max_q_blocks, max_k_blocks: Python ints bounding the output (``xattn_max_blocks``).
        stride, block, threshold, scale: XAttention parameters (config xattn_stride, xattn_block,
            xattn_threshold); block / stride must be a power of two.

    Returns:
        (xa_block_idx [B, Hkv, max_q_blocks, max_k_blocks] int32, xa_block_cnt [B, Hkv, max_q_blocks]
        int32), the metadata ``prefill_attention`` takes. No host synchronisation.
    """
    B, hq, hkv, d, bs = check_paged_batch(
        q, key_cache, None, seq_lens, block_table, head_modes, head_mode_slots, query_start_loc
    )
    dev = q.device
    if stride < 1 or block % stride:
        raise ValueError(f"block: {block} must be a multiple of stride {stride}")
    per = block // stride
    if per & (per - 1):
        raise ValueError(f"block/stride: {per} groups per block, a power of two is required")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold: must be in (0, 1], got {threshold}")
    if max_q_blocks < 1 or max_k_blocks < 1:
        raise ValueError(f"max_q_blocks/max_k_blocks: must be >= 1, got {max_q_blocks}/{max_k_blocks}")
    g = hq // hkv
    idx = torch.empty(B, hkv, max_q_blocks, max_k_blocks, device=dev, dtype=torch.int32)
    cnt = torch.empty(B, hkv, max_q_blocks, device=dev, dtype=torch.int32)
    if B == 0:
        return idx, cnt
    mass = torch.empty(B, hkv, max_q_blocks, max_k_blocks, device=dev, dtype=torch.float32)
    kpt = max(1, 64 // per)  # key tiles of 64 stride groups (8 blocks at block 128, stride 16)
    scale = d**-0.5 if scale is None else scale
    hm_slots = head_mode_slots if head_mode_slots is not None else seq_lens
    _xattn_select_kernel[(max_q_blocks, hkv, B)](
        q, key_cache, block_table, query_start_loc, seq_lens, head_modes, hm_slots, idx, cnt, mass,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), head_modes.stride(0), head_modes.stride(1),
        idx.stride(0), idx.stride(1), idx.stride(2), cnt.stride(0), cnt.stride(1),
        max_k_blocks, float(threshold), scale / stride * 1.4426950408889634,
        G=g, STRIDE=stride, BLOCK=block, PER=per, KPT=kpt, BLOCK_R=max(16, next_pow2(per * g)), BS=bs,
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), SEL_T=256, HAS_SLOTS=head_mode_slots is not None,
        DOT_PREC=dot_precision(q.dtype), num_warps=4, num_stages=2,
    )  # fmt: skip
    return idx, cnt


def block_masks_to_lists(
    masks: list[torch.Tensor | None],
    seq_lens: list[int],
    query_lens: list[int],
    block: int,
    max_q_blocks: int,
    max_k_blocks: int,
    num_kv_heads: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host helper: reference bool masks [Hkv, nb, nb] (absolute blocks) -> (xa_block_idx, xa_block_cnt)."""
    B = len(seq_lens)
    idx = torch.zeros(B, num_kv_heads, max_q_blocks, max_k_blocks, dtype=torch.int32)
    cnt = torch.zeros(B, num_kv_heads, max_q_blocks, dtype=torch.int32)
    for b, (m, s, ql) in enumerate(zip(masks, seq_lens, query_lens)):
        if m is None or ql == 0:
            continue
        lo, hi = (s - ql) // block, (s - 1) // block
        for h in range(num_kv_heads):
            for a in range(lo, hi + 1):
                sel = torch.nonzero(m[h, a]).flatten()
                cnt[b, h, a - lo] = sel.numel()
                idx[b, h, a - lo, : sel.numel()] = sel.to(torch.int32)
    return idx.to(device), cnt.to(device)


def lists_to_block_masks(
    idx: torch.Tensor, cnt: torch.Tensor, seq_lens: list[int], query_lens: list[int], block: int
) -> list[torch.Tensor]:
    """Host helper: (xa_block_idx, xa_block_cnt) -> per-request bool masks [Hkv, nb, nb] (absolute blocks)."""
    idx, cnt = idx.cpu(), cnt.cpu()
    out = []
    for b, (s, ql) in enumerate(zip(seq_lens, query_lens)):
        nb = max(triton.cdiv(s, block), 1)
        m = torch.zeros(idx.shape[1], nb, nb, dtype=torch.bool)
        if ql:
            lo, hi = (s - ql) // block, (s - 1) // block
            for h in range(idx.shape[1]):
                for a in range(lo, hi + 1):
                    n = int(cnt[b, h, a - lo])
                    m[h, a, idx[b, h, a - lo, :n].long()] = True
        out.append(m)
    return out
