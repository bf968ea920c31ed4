"""Hybrid decode attention (one query token per request) over a paged KV cache, split-KV.

Each program owns one (request, KV head, split): the G query heads of the KV head are the rows
of the tile (padded to 16 for the tensor cores), and the split is a contiguous run of the key
tiles the head's mode makes visible to the query at position seq_len-1::

    FA  (mode 0, and XA: see below): tiles 0 .. cdiv(seq_len, BLOCK_N)-1
    SSA (mode 1): sink tiles, then window tiles        x x . . . . . x x x

The grid has a fixed number of splits per (request, KV head), sized from an upper bound of the
sequence lengths (a Python int: CUDA-graph safe). Each (request, head) spreads the tiles it
really reads evenly over those splits, at least ``min_tiles`` per split: a 32K request in a
graph captured for 128K, or an SSA head reading ~10 tiles, still keeps its splits short, so the
critical path is the work of one (request, head) divided by the split count, not a fixed split
size chosen for the longest possible sequence (the first H200 run: dense and sparse decode at
32K x 16 took the same time because every FA program walked 228 tiles). Programs left without
tiles exit at once. Partial results (normalised output + log2-sum-exp per split) are merged by a
second small kernel; with one split the first kernel writes the output directly.

decode_mode is the caller's choice, expressed through head_modes: pass FA for every head that
must read the whole context (decode_mode="dense"), SSA for heads that keep sink+window
(decode_mode="sparse"). XA heads decode as FA (project decision: the XA selection is a prefill
estimate); the kernel treats mode 2 exactly as mode 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastic_vllm.ops._attn import attn_step
from elastic_vllm.ops._common import (
    check_paged_batch,
    check_ssa,
    check_tensor,
    dot_precision,
    interpret,
    next_pow2,
    num_sms,
    resolve_pdl,
)


# num_splits / min_tiles follow the longest context of the step, the block table's row stride follows
# max_model_len (the warm-up's differs): not specialised, so one compiled kernel serves every length and the
# warm-up's synthetic batch (the merge kernel's BLOCK_S, a power of two of the splits, is compiled at warm-up).
# The q / o / cache strides stay specialised: their divisibility by 16 is what lets the
# compiler use 16-byte loads; without it the sm_90 build loads keys in 2-byte pieces (260 LDG.E.U16, 5.5 KB of
# spills) and the H200 served 1K prompts at 11.8 vs 7.4 ms median inter-token latency.
@triton.jit(do_not_specialize=["num_splits", "min_tiles", "s_bt", "s_hm0"])
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    o,
    o_part,
    lse_part,
    block_table,
    seq_lens,
    head_modes,
    head_mode_slots,
    s_qb,
    s_qh,
    s_ob,
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
    num_splits,
    min_tiles,
    sink,
    window,
    qk_scale,
    G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the merge kernel may launch (and wait in griddepcontrol.wait) once every split started
        tl.extra.cuda.gdc_launch_dependents()
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    seq_len = tl.load(seq_lens + i_b)
    if HAS_SLOTS:
        i_row = tl.load(head_mode_slots + i_b).to(tl.int64)
    else:
        i_row = i_b.to(tl.int64)
    mode = tl.load(head_modes + i_row * s_hm0 + i_h * s_hm1).to(tl.int32)
    is_ssa = mode == 1
    eff_sink = tl.where(is_ssa, sink, 0)
    eff_window = tl.where(is_ssa, window, 1 << 30)
    # visible tiles for the query at seq_len-1: sink [0, s_hi), window [w_lo, w_hi)
    s_hi = tl.cdiv(tl.minimum(eff_sink, seq_len), BLOCK_N)
    w_lo = tl.maximum(s_hi, tl.maximum(seq_len - eff_window, 0) // BLOCK_N)
    w_hi = tl.cdiv(seq_len, BLOCK_N)
    n_vis = s_hi + tl.maximum(w_hi - w_lo, 0)
    # balanced: this (request, head)'s visible tiles spread over the splits, >= min_tiles each
    tps = tl.maximum(tl.cdiv(n_vis, num_splits), min_tiles)
    v_lo = i_s * tps
    v_hi = tl.minimum(v_lo + tps, n_vis)

    o_m = tl.arange(0, BLOCK_H)
    m_row = o_m < G
    o_hq = i_h * G + tl.where(m_row, o_m, 0)  # [BH]
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    if SPLIT:
        # o_part [B, Hq, num_splits, D] fp32, lse_part [B, Hq, num_splits] fp32, contiguous
        o_pr = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + o_hq) * num_splits + i_s  # [BH]
        if v_lo >= v_hi:
            tl.store(lse_part + o_pr, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=m_row)
            return
    p_q = q + i_b.to(tl.int64) * s_qb + (o_hq * s_qh)[:, None] + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BH, BD]
    q_pos = tl.where(m_row, seq_len - 1, -1)  # [BH]
    p_k = k_cache + i_h.to(tl.int64) * s_kh
    p_v = v_cache + i_h.to(tl.int64) * s_vh
    p_bt = block_table + i_b.to(tl.int64) * s_bt
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    for i_v in range(v_lo, v_hi):
        i_n = tl.where(i_v < s_hi, i_v, w_lo + i_v - s_hi)
        acc, l_i, m_i = attn_step(
            acc, l_i, m_i, b_q, p_k, p_v, p_bt, i_n * BLOCK_N, q_pos, q_pos, seq_len, eff_sink, eff_window,
            s_kb, s_kt, s_vb, s_vt, o_d, qk_scale,
            BS, BLOCK_N, HEAD_DIM, BLOCK_D, TILE_IN_BLOCK, True, False, DOT_PREC,
        )  # fmt: skip
    l_s = tl.where(l_i > 0.0, l_i, 1.0)
    b_o = acc / l_s[:, None]
    if SPLIT:
        tl.store(o_part + o_pr[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_row[:, None] & m_d[None, :])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_s), float("-inf"))
        tl.store(lse_part + o_pr, lse, mask=m_row)
    else:
        p_o = o + i_b.to(tl.int64) * s_ob + (o_hq * s_oh)[:, None] + o_d[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    o,
    o_part,
    lse_part,
    s_ob,
    s_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched as a programmatic dependent of the split kernel: its partials are visible after this
        tl.extra.cuda.gdc_wait()
    i_b = tl.program_id(0)
    i_hq = tl.program_id(1)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    o_row = (i_b.to(tl.int64) * tl.num_programs(1) + i_hq) * num_splits
    b_lse = tl.load(lse_part + o_row + o_s, mask=o_s < num_splits, other=float("-inf"))  # [BS]
    m = tl.max(b_lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(b_lse - m)  # [BS], 0 for empty splits
    live = b_lse > float("-inf")
    p_o = o_part + (o_row + o_s)[:, None] * HEAD_DIM + o_d[None, :]
    b_o = tl.load(p_o, mask=live[:, None] & (o_d < HEAD_DIM)[None, :], other=0.0)  # [BS, BD]
    den = tl.sum(w, 0)
    den = tl.where(den > 0.0, den, 1.0)
    b_out = tl.sum(b_o * w[:, None], 0) / den
    tl.store(o + i_b.to(tl.int64) * s_ob + i_hq * s_oh + o_d, b_out.to(o.dtype.element_ty), mask=o_d < HEAD_DIM)


def default_decode_config(head_dim: int) -> dict:
    if interpret():
        return {"block_n": 32, "num_warps": 4, "num_stages": 1}
    # 128-key tiles, 2 stages: on the H200 from a CUDA graph, 2-8% faster than the former 64 keys / 3 stages at
    # every decode shape swept, sparse and dense (kernels.py section ``decode config``, results/experiments/kernels-14-h200-decode-config-d76fe67.json:
    # 32K x 16 sparse 0.1777 -> 0.1740 ms, 128K x 4 sparse 0.1548 -> 0.1450, dense 0.526 -> 0.503)
    return {"block_n": 128, "num_warps": 4, "num_stages": 2}


def decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Splits per (request, KV head): ~32 programs per SM over all (request, KV head) pairs, at most
    one split per SM for a pair, and at least 8 key tiles per split. A function of Python ints only
    (CUDA-graph safe). Why 32, not 8: with 75% SSA heads the work sits in the FA heads' quarter of
    the programs, and the SSA heads use only the splits their few tiles need; on the H200 4x the
    splits made 75%-SSA decode 11% faster at 32K x 16 (0.213 -> 0.190 ms) and 128K x 4
    (0.185 -> 0.165 ms), and dense no slower (0.568 -> 0.534, 0.548 -> 0.542 ms)."""
    sms = num_sms(device)
    tiles = max(triton.cdiv(max_seq_len, block_n), 1)
    want = min(triton.cdiv(32 * sms, max(batch * num_kv_heads, 1)), sms)
    return max(1, min(want, triton.cdiv(tiles, 8), 256))


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_modes: torch.Tensor,
    *,
    sink: int,
    window: int,
    max_seq_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    head_mode_slots: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Decode attention: one query per request, per-(request, KV head) FA or SSA, split-KV.

    Args:
        q: [B, Hq, D], the query of request b at position seq_lens[b]-1.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (any strides, D contiguous).
        block_table: [B, max_blocks] int32. seq_lens: [B] int32 (0 allowed: padded rows give 0).
        head_modes: [B, Hkv] int HeadMode (1 = SSA reads sink + window; 0 FA and 2 XA read all);
            with ``head_mode_slots`` [B] int32 a [slots, Hkv] table read at row head_mode_slots[b].
        max_seq_len: an upper bound of seq_lens (Python int, e.g. max_model_len under CUDA graphs);
            sizes the split-KV grid, so the launch depends on no device value.
        num_splits: override of the split count (1 = no merge kernel).
        pdl: launch the merge kernel as a programmatic dependent launch of the split kernel (its launch
            overlaps the splits' tail; default: on sm_90+ CUDA; True elsewhere is a ValueError).

    Returns:
        out [B, Hq, D] in q's dtype. No host synchronisation; CUDA-graph capturable.
    """
    B, hq, hkv, d, bs = check_paged_batch(q, key_cache, value_cache, seq_lens, block_table, head_modes, head_mode_slots)
    dev = q.device
    check_ssa(sink, window)
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len: a Python int >= 0 is required, got {max_seq_len!r}")
    use_pdl = resolve_pdl(pdl, dev)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor(out, "out", dim=3, dtypes=(q.dtype,), shape=tuple(q.shape), device=dev, last_contiguous=True)
    if B == 0:
        return out

    g = hq // hkv
    cfg = default_decode_config(d)
    bn = block_n or cfg["block_n"]
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n: a power of two >= 16 required, got {bn}")
    tiles = max(triton.cdiv(max_seq_len, bn), 1)
    ns = num_splits or decode_num_splits(B, hkv, max_seq_len, bn, dev)
    if ns < 1:
        raise ValueError(f"num_splits: must be >= 1, got {ns}")
    ns = min(ns, tiles)
    split = ns > 1
    # one split: the program walks every visible tile; otherwise >= 8 tiles per split (fewer when the
    # bound itself is short), spread evenly per (request, head) inside the kernel
    min_tiles = tiles if not split else max(1, min(8, tiles // ns))
    scale = d**-0.5 if scale is None else scale
    if split:
        o_part = torch.empty(B, hq, ns, d, device=dev, dtype=torch.float32)
        lse_part = torch.empty(B, hq, ns, device=dev, dtype=torch.float32)
    else:
        o_part = lse_part = out
    hm_slots = head_mode_slots if head_mode_slots is not None else seq_lens
    block_d = max(next_pow2(d), 16)
    _decode_kernel[(ns, hkv, B)](
        q, key_cache, value_cache, out, o_part, lse_part, block_table, seq_lens, head_modes, hm_slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), head_modes.stride(0), head_modes.stride(1),
        ns, min_tiles, sink, window, scale * 1.4426950408889634,
        G=g, BLOCK_H=max(16, next_pow2(g)), BLOCK_N=bn, BS=bs, HEAD_DIM=d, BLOCK_D=block_d,
        TILE_IN_BLOCK=bs % bn == 0, HAS_SLOTS=head_mode_slots is not None, SPLIT=split,
        DOT_PREC=dot_precision(q.dtype), USE_PDL=split and use_pdl,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )  # fmt: skip
    if split:
        _decode_merge_kernel[(B, hq)](
            out, o_part, lse_part, out.stride(0), out.stride(1), ns,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(next_pow2(ns), 2), USE_PDL=use_pdl, num_warps=4,
            **({"launch_pdl": True} if use_pdl else {}),
        )  # fmt: skip
    return out
