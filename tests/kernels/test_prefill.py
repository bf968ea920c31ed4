"""Fused hybrid prefill kernel (elastic_vllm/ops/prefill/kernel.py) against the reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import zlib

import pytest
import torch
from kutils import assert_close, no_host_sync, random_modes, strided_caches
from testlib import nan_like

from elastic_vllm.config import HeadMode
from elastic_vllm.ops import _common
from elastic_vllm.ops.prefill.kernel import prefill_attention
from elastic_vllm.ops.xattn_select.kernel import block_masks_to_lists
from elastic_vllm.reference.attention import hybrid_attention_ref
from elastic_vllm.reference.paged import make_paged_batch

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)


def test_mode_constants_match_config():
    assert (_common.MODE_FA, _common.MODE_SSA, _common.MODE_XA) == (FA, SSA, XA)


def run(batch, modes, sink, window, dtype_out=None, xa=None, **kw):
    out = nan_like(batch.q)
    ret = prefill_attention(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, modes, sink=sink, window=window, out=out, **kw,
    )  # fmt: skip
    assert ret is out
    return out


def ref(batch, modes, sink, window, masks=None, blk=128):
    return hybrid_attention_ref(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, modes, sink, window, xa_block_masks=masks, xa_block=blk,
    )  # fmt: skip


# name: (seq_lens, query_lens, Hq, Hkv, D, block_size, sink, window, modes, tiles (block_m, block_n))
CASES = {
    "ragged_varlen_gqa2": ([1, 63, 113], [1, 63, 113], 4, 2, 32, 16, 4, 20, (FA, SSA), (32, 16)),
    "gqa1_bs32": ([63, 40], [63, 40], 2, 2, 32, 32, 3, 17, (FA, SSA), (32, 32)),
    "gqa3_d24": ([50, 77], [50, 77], 6, 2, 24, 16, 5, 9, (FA, SSA), (64, 16)),
    "gqa4_tile_in_block": ([90, 33], [90, 33], 8, 2, 16, 64, 8, 30, (FA, SSA), (64, 32)),
    "gqa8_d64": ([70], [70], 8, 1, 64, 16, 4, 16, (SSA,), (64, 16)),
    "chunked_prefill": ([70, 90, 200], [20, 33, 77], 4, 2, 16, 16, 6, 25, (FA, SSA), (32, 16)),
    "mixed_decode_rows": ([100, 17, 60, 5], [1, 17, 12, 1], 4, 2, 16, 16, 4, 10, (FA, SSA), (32, 16)),
    "empty_request": ([30, 12, 40], [30, 0, 5], 4, 2, 16, 16, 2, 7, (FA, SSA), (32, 16)),
    "sink0_window1_diag_only": ([45], [45], 4, 2, 16, 16, 0, 1, (SSA,), (32, 16)),
    "window_covers_all": ([45], [45], 4, 2, 16, 16, 0, 1000, (FA, SSA), (32, 16)),
    "sink_covers_all": ([45], [45], 4, 2, 16, 16, 1000, 3, (FA, SSA), (32, 16)),
    "all_fa": ([60, 9], [60, 9], 4, 2, 16, 16, 4, 8, (FA,), (32, 16)),
    "default_tiles": ([80, 130], [80, 60], 4, 2, 32, 16, 8, 40, (FA, SSA), None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_matches_reference(name):
    seqs, qls, hq, hkv, d, bs, sink, window, modes, tiles = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    batch = make_paged_batch(seqs, qls, hq, hkv, d, block_size=bs, generator=gen)
    hm = random_modes(len(seqs), hkv, modes, gen)
    kw = {} if tiles is None else {"block_m": tiles[0], "block_n": tiles[1]}
    out = run(batch, hm, sink, window, **kw)
    assert_close(out, ref(batch, hm, sink, window), name)


@pytest.mark.parametrize(
    "bs,block_n,strided",
    [(32, 32, False), (64, 32, True), (64, 64, False)],
    ids=["bs32-bn32", "bs64-bn32-strided", "bs64-bn64"],
)
def test_prefill_tiles_inside_blocks(bs, block_n, strided):
    """Key tiles inside one cache block (one block-table read per tile, affine addresses), at offsets inside the
    block and through views of a [num_blocks, 2, block_size, H, D] cache."""
    gen = torch.Generator().manual_seed(17)
    batch = make_paged_batch([300, 90, 33, 1], [300, 33, 33, 1], 8, 2, 32, block_size=bs, generator=gen)
    hm = torch.tensor([[FA, SSA], [SSA, FA], [FA, FA], [SSA, FA]], dtype=torch.int8)
    if strided:
        batch.key_cache, batch.value_cache = strided_caches(batch)
    out = run(batch, hm, 4, 40, block_m=32, block_n=block_n)
    assert_close(out, ref(batch, hm, 4, 40), "tiles-in-blocks")


def test_prefill_xa_heads_tiles_inside_blocks():
    gen = torch.Generator().manual_seed(19)
    seqs, qls, blk = [200, 130], [200, 50], 32
    batch = make_paged_batch(seqs, qls, 4, 2, 16, block_size=32, generator=gen)
    hm = torch.tensor([[XA, FA], [SSA, XA]], dtype=torch.int8)
    masks = random_xa_masks(seqs, 2, blk, gen)
    mq = max(-(-q // blk) + 1 for q in qls)
    mk = max(-(-s // blk) for s in seqs)
    idx, cnt = block_masks_to_lists(masks, seqs, qls, blk, mq, mk, 2)
    out = run(batch, hm, 4, 20, xa_block_idx=idx, xa_block_cnt=cnt, xattn_block=blk, block_m=32, block_n=32)
    assert_close(out, ref(batch, hm, 4, 20, masks, blk), "xa-tiles-in-blocks")


def test_prefill_long_ragged_1023():
    gen = torch.Generator().manual_seed(7)
    batch = make_paged_batch([1023], [1023], 2, 2, 16, block_size=16, generator=gen)
    hm = torch.tensor([[FA, SSA]], dtype=torch.int8)
    out = run(batch, hm, 16, 100, block_m=64, block_n=64)
    assert_close(out, ref(batch, hm, 16, 100), "1023")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_dtypes_strided_cache_and_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([70, 50], [30, 50], 8, 2, 32, block_size=16, dtype=dtype, generator=gen)
    kc, vc = strided_caches(batch)
    assert not kc.is_contiguous()
    hm = torch.tensor([[FA, SSA], [SSA, FA]], dtype=torch.int8)
    # a persistent [slots, layers, Hkv] table read through slot indices, as the vLLM backend does
    table = torch.full((5, 3, 2), 7, dtype=torch.int8)
    table[3, 1], table[0, 1] = hm[0], hm[1]
    slots = torch.tensor([3, 0], dtype=torch.int32)
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, kc, vc, batch.block_table, batch.query_start_loc, batch.seq_lens, table[:, 1],
        sink=4, window=12, out=out, head_mode_slots=slots, block_m=32, block_n=16,
    )  # fmt: skip
    assert_close(out, ref(batch, hm, 4, 12), str(dtype))


def random_xa_masks(seqs, hkv, blk, gen):
    masks = []
    for s in seqs:
        nb = -(-s // blk)
        m = (torch.rand(hkv, nb, nb, generator=gen) < 0.5) & torch.tril(torch.ones(nb, nb, dtype=torch.bool))
        m[:, :, 0] = True  # every query sees key 0, so no row is empty
        masks.append(m)
    return masks


@pytest.mark.parametrize(
    "seqs,qls,tiles",
    [
        ([200, 64], [200, 64], (32, 16)),  # aligned tiles
        ([130, 97, 70], [50, 97, 3], (64, 16)),  # chunks start mid-block: tiles straddle two query blocks
    ],
)
def test_prefill_xa_and_mixed_modes(seqs, qls, tiles):
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, blk = 4, 2, 16, 32
    batch = make_paged_batch(seqs, qls, hq, hkv, d, block_size=16, generator=gen)
    hm = random_modes(len(seqs), hkv, (FA, SSA, XA), gen)
    hm[0, 0] = XA
    masks = random_xa_masks(seqs, hkv, blk, gen)
    mq = max(-(-q // blk) + 1 for q in qls)
    mk = max(-(-s // blk) for s in seqs)
    idx, cnt = block_masks_to_lists(masks, seqs, qls, blk, mq, mk, hkv)
    out = run(batch, hm, 4, 20, xa_block_idx=idx, xa_block_cnt=cnt, xattn_block=blk, block_m=tiles[0], block_n=tiles[1])
    assert_close(out, ref(batch, hm, 4, 20, masks, blk), "xa")


def test_prefill_xa_without_metadata_runs_as_fa():
    gen = torch.Generator().manual_seed(5)
    batch = make_paged_batch([40], [40], 4, 2, 16, block_size=16, generator=gen)
    out = run(batch, torch.tensor([[XA, SSA]], dtype=torch.int8), 2, 5, block_m=32, block_n=16)
    assert_close(out, ref(batch, torch.tensor([[FA, SSA]], dtype=torch.int8), 2, 5), "xa-as-fa")


def test_prefill_no_host_sync():
    gen = torch.Generator().manual_seed(1)
    batch = make_paged_batch([30, 20], [30, 4], 4, 2, 16, block_size=16, generator=gen)
    hm = torch.tensor([[FA, SSA], [SSA, FA]], dtype=torch.int8)
    with no_host_sync():
        out = prefill_attention(
            batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, hm, sink=2, window=6, block_m=32, block_n=16,
        )  # fmt: skip
    assert_close(out, ref(batch, hm, 2, 6), "no-sync")


def test_prefill_launcher_errors_name_the_argument():
    batch = make_paged_batch([20], [20], 4, 2, 16, block_size=16)
    hm = torch.zeros(1, 2, dtype=torch.int8)
    args = (batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    with pytest.raises(ValueError, match="head_modes"):
        prefill_attention(*args, torch.zeros(1, 3, dtype=torch.int8), sink=1, window=2)
    with pytest.raises(ValueError, match="head_modes"):
        prefill_attention(*args, hm.float(), sink=1, window=2)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(*args[:4], torch.zeros(3, dtype=torch.int32), args[5], hm, sink=1, window=2)
    with pytest.raises(ValueError, match="value_cache"):
        prefill_attention(args[0], args[1], args[2][..., :8], *args[3:], hm, sink=1, window=2)
    with pytest.raises(ValueError, match="q: 5 query heads"):
        prefill_attention(torch.zeros(20, 5, 16), *args[1:], hm, sink=1, window=2)
    with pytest.raises(ValueError, match="key_cache: dtype"):
        prefill_attention(args[0].half(), *args[1:], hm, sink=1, window=2)
    with pytest.raises(ValueError, match="xa_block_idx"):
        prefill_attention(*args, hm, sink=1, window=2, xa_block_cnt=torch.zeros(1, 2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="window"):
        prefill_attention(*args, hm, sink=1, window=0)
    with pytest.raises(ValueError, match="block_table"):
        prefill_attention(*args[:3], args[3].float(), *args[4:], hm, sink=1, window=2)


def test_prefill_program_order_with_many_heads():
    """Five KV heads whose long (FA/XA) and SSA heads differ per request, some request with none of
    one kind, through the slot table: the long-first order must map every (tile, head) to exactly one
    program (NaN-poisoned output) and give the reference's result."""
    gen = torch.Generator().manual_seed(23)
    seqs, qls = [150, 90, 61, 40], [150, 45, 61, 1]
    batch = make_paged_batch(seqs, qls, 10, 5, 16, block_size=16, generator=gen)
    hm = torch.tensor(
        [[SSA, FA, SSA, SSA, FA], [FA, FA, FA, FA, FA], [SSA, SSA, SSA, SSA, SSA], [FA, SSA, XA, SSA, SSA]],
        dtype=torch.int8,
    )
    table = torch.full((6, 2, 5), 7, dtype=torch.int8)
    slots = torch.tensor([4, 1, 5, 0], dtype=torch.int32)
    table[slots.long(), 1] = hm
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        table[:, 1], sink=4, window=24, out=out, head_mode_slots=slots, block_m=32, block_n=16,
    )  # fmt: skip
    hm_ref = torch.where(hm == XA, FA, hm)  # no XA metadata: XA runs as FA
    assert_close(out, ref(batch, hm_ref, 4, 24), "long-first")


# ------------------------------------------------------------------------------------------ cache contents
def poison_unheld(batch: object, seqs: list[int]) -> None:
    """NaN in every cache slot no request holds (past each seq_len, spare blocks): reading one, even times a
    zero probability, makes the output NaN."""
    bs = batch.key_cache.shape[1]
    held = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for b, s in enumerate(seqs):
        pos = torch.arange(s)
        held[batch.block_table[b, pos // bs].long(), pos % bs] = True
    batch.key_cache[~held] = float("nan")
    batch.value_cache[~held] = float("nan")


NAN_CASES = {
    # name: (seq_lens, query_lens, Hq, Hkv, D, block_size, sink, window, tiles (block_m, block_n))
    "varlen_chunked_empty_decode_rows": ([70, 90, 200, 5, 33], [20, 90, 77, 0, 1], 4, 2, 32, 32, 4, 25, (16, 32)),
    "tile_crosses_seq_len_mid_block": ([75, 41], [75, 41], 2, 1, 16, 64, 3, 20, (32, 32)),
    "sink0_window1": ([45], [45], 4, 2, 16, 16, 0, 1, (16, 16)),
    "sink_and_window_cover_all": ([45, 30], [45, 30], 4, 2, 16, 16, 1000, 1000, (16, 16)),
}


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_prefill_matches_reference_with_nan_past_seq_len(name):
    """NaN in every unheld cache slot and in the output: a key or value read past seq_len (masked tiles load
    zeros there) or a missed row fails."""
    seqs, qls, hq, hkv, d, bs, sink, window, (bm, bn) = NAN_CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    batch = make_paged_batch(seqs, qls, hq, hkv, d, block_size=bs, dtype=torch.float16, generator=gen)
    poison_unheld(batch, seqs)
    hm = random_modes(len(seqs), hkv, (FA, SSA), gen)
    out = run(batch, hm, sink, window, block_m=bm, block_n=bn)
    assert_close(out, ref(batch, hm, sink, window), name)


def test_prefill_vllm_layout_slots_and_xa_as_fa():
    """vLLM's cache layout for this backend ([blocks, bs, Hkv, 2D], K and V interleaved per head), the
    persistent slot table, q as a view of a wider qkv row, and XA heads without metadata (run as FA)."""
    gen = torch.Generator().manual_seed(29)
    seqs, qls, hq, hkv, d = [100, 64, 9], [36, 64, 9], 8, 2, 32
    batch = make_paged_batch(seqs, qls, hq, hkv, d, block_size=32, dtype=torch.float16, generator=gen)
    il = torch.cat([batch.key_cache, batch.value_cache], dim=-1)
    kc, vc = il[..., :d], il[..., d:]
    qkv = torch.randn(batch.q.shape[0], (hq + 2 * hkv) * d, generator=gen).half()
    qkv[:, : hq * d] = batch.q.reshape(-1, hq * d)
    q = qkv[:, : hq * d].view(-1, hq, d)
    assert q.stride(0) == (hq + 2 * hkv) * d
    hm = torch.tensor([[XA, SSA], [SSA, FA], [SSA, SSA]], dtype=torch.int8)
    table = torch.full((4, 3, hkv), 7, dtype=torch.int8)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    table[slots.long(), 1] = hm
    out = nan_like(batch.q)
    prefill_attention(
        q, kc, vc, batch.block_table, batch.query_start_loc, batch.seq_lens, table[:, 1], sink=4, window=20,
        out=out, head_mode_slots=slots, block_m=16, block_n=32,
    )  # fmt: skip
    assert_close(out, ref(batch, torch.where(hm == XA, FA, hm), 4, 20), "vllm-layout")


@pytest.mark.parametrize("xa", [False, True], ids=["fa_ssa", "fa_xa"])
def test_prefill_skip_fa_writes_only_the_other_heads(xa):
    """``skip_fa``: FA (row, head) outputs keep their NaN poison bit for bit, every SSA / XA output matches the
    reference (chunked rows, a decode-like row, GQA 2)."""
    gen = torch.Generator().manual_seed(23)
    seqs, qls, blk = [130, 97, 70, 9], [50, 97, 3, 9], 32
    batch = make_paged_batch(seqs, qls, 4, 2, 16, block_size=16, generator=gen)
    hm = torch.tensor([[FA, SSA], [XA if xa else SSA, FA], [FA, FA], [SSA, SSA]], dtype=torch.int8)
    kw, masks = {}, None
    if xa:
        masks = random_xa_masks(seqs, 2, blk, gen)
        mq = max(-(-q // blk) + 1 for q in qls)
        mk = max(-(-s // blk) for s in seqs)
        idx, cnt = block_masks_to_lists(masks, seqs, qls, blk, mq, mk, 2)
        kw = dict(xa_block_idx=idx, xa_block_cnt=cnt, xattn_block=blk)
    out = run(batch, hm, 4, 20, skip_fa=True, block_m=32, block_n=16, **kw)
    expect = ref(batch, hm, 4, 20, masks, blk)
    qsl = batch.query_start_loc.tolist()
    for b in range(len(seqs)):
        for h in range(2):
            o, e = out[qsl[b] : qsl[b + 1], 2 * h : 2 * h + 2], expect[qsl[b] : qsl[b + 1], 2 * h : 2 * h + 2]
            if hm[b, h] == FA:
                assert torch.isnan(o).all(), (b, h)
            else:
                assert_close(o, e, f"row {b} head {h}")
