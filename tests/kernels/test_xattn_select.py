"""XAttention block selection kernel (elastic_vllm/ops/xattn_select/kernel.py) against xattn_block_mask_ref, TRITON_INTERPRET=1.

Tolerance: the selection equals the reference's except where a cumulative mass sits within
float32 rounding of the threshold; these seeded random inputs have no such near-ties, so the
masks must be identical.
"""

from __future__ import annotations

import pytest
import torch
from kutils import assert_close, no_host_sync
from testlib import nan_like

from elastic_vllm.config import HeadMode
from elastic_vllm.ops.prefill.kernel import prefill_attention
from elastic_vllm.ops.xattn_select.kernel import (
    block_masks_to_lists,
    lists_to_block_masks,
    xattn_max_blocks,
    xattn_select,
)
from elastic_vllm.ops.xattn_select.naive import xattn_block_mask_ref
from elastic_vllm.reference.attention import hybrid_attention_ref
from elastic_vllm.reference.paged import make_paged_batch

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)


def ref_masks(batch, seqs, qls, stride, blk, thr):
    hq, hkv = batch.q.shape[1], batch.key_cache.shape[2]
    g = hq // hkv
    qsl = batch.query_start_loc.tolist()
    out = []
    for b, (s, ql) in enumerate(zip(seqs, qls)):
        q = batch.q[qsl[b] : qsl[b + 1]]
        out.append(
            torch.stack(
                [
                    xattn_block_mask_ref(q[:, h * g : (h + 1) * g], batch.keys[b][:, h], s - ql, stride, blk, thr)
                    for h in range(hkv)
                ]
            )
        )
    return out


def select(batch, hm, seqs, qls, stride, blk, thr, **kw):
    mq, mk = xattn_max_blocks(max(qls), max(seqs), blk)
    return xattn_select(
        batch.q, batch.key_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, hm,
        max_q_blocks=mq, max_k_blocks=mk, stride=stride, block=blk, threshold=thr, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "seqs,qls,hq,hkv,stride,blk,thr",
    [
        ([200, 64], [200, 64], 4, 2, 8, 32, 0.8),  # full prefill, GQA 2
        ([130, 97], [50, 1], 3, 1, 8, 32, 0.9),  # chunk starting mid-block, GQA 3, single-token row
        ([256], [256], 2, 2, 4, 16, 0.5),  # GQA 1, 4 groups per block
        ([160], [160], 4, 1, 8, 32, 1.0),  # threshold 1: every causal block
    ],
    ids=["prefill-gqa2", "chunked-gqa3", "gqa1-stride4", "threshold1"],
)
def test_selection_equals_reference(seqs, qls, hq, hkv, stride, blk, thr):
    gen = torch.Generator().manual_seed(sum(seqs) + hq)
    batch = make_paged_batch(seqs, qls, hq, hkv, 16, block_size=16, generator=gen)
    hm = torch.full((len(seqs), hkv), XA, dtype=torch.int8)
    idx, cnt = select(batch, hm, seqs, qls, stride, blk, thr)
    got = lists_to_block_masks(idx, cnt, seqs, qls, blk)
    want = ref_masks(batch, seqs, qls, stride, blk, thr)
    for b in range(len(seqs)):
        assert torch.equal(got[b], want[b]), f"request {b}: selections differ"
        lo = (seqs[b] - qls[b]) // blk
        rows = cnt[b, :, : (seqs[b] - 1) // blk - lo + 1]
        for h in range(hkv):  # lists ascending
            for a in range(rows.shape[1]):
                lst = idx[b, h, a, : rows[h, a]]
                assert torch.all(lst[1:] > lst[:-1])


@pytest.mark.parametrize("thr", [0.3, 0.6, 1.0])
def test_tied_masses_keep_the_lower_blocks_as_the_reference(thr):
    """Zero queries: every estimate is 0, so all key blocks below the diagonal get exactly the same mass.
    The kernel finds the kept set without a sort (bisection over the masses); ties must still go to the
    lower block index, as in the reference's (mass desc, index asc) order, and the kept count must match."""
    seqs, qls, stride, blk = [256, 200], [256, 120], 8, 32
    gen = torch.Generator().manual_seed(5)
    batch = make_paged_batch(seqs, qls, 4, 2, 16, block_size=16, generator=gen)
    batch.q.zero_()
    hm = torch.full((2, 2), XA, dtype=torch.int8)
    idx, cnt = select(batch, hm, seqs, qls, stride, blk, thr)
    got = lists_to_block_masks(idx, cnt, seqs, qls, blk)
    want = ref_masks(batch, seqs, qls, stride, blk, thr)
    for b in range(2):
        assert torch.equal(got[b], want[b]), f"request {b}: selections differ"
    # the tie rule is really exercised: a middle row keeps a proper prefix of its lower blocks (+ diagonal)
    row = got[0][0, 6]
    if thr < 1.0:
        n = int(row[:6].sum())
        assert 0 < n < 6 and row[:n].all() and not row[n:6].any() and row[6]
    else:
        assert row[:7].all()


def test_non_xa_heads_are_skipped_and_selection_drives_prefill():
    seqs, qls, blk, stride = [180, 120], [180, 70], 32, 8
    gen = torch.Generator().manual_seed(9)
    batch = make_paged_batch(seqs, qls, 4, 2, 16, block_size=16, generator=gen)
    hm = torch.tensor([[XA, FA], [SSA, XA]], dtype=torch.int8)
    with no_host_sync():
        idx, cnt = select(batch, hm, seqs, qls, stride, blk, 0.7)
    assert int(cnt[0, 1].abs().sum()) == 0 and int(cnt[1, 0].abs().sum()) == 0
    masks = lists_to_block_masks(idx, cnt, seqs, qls, blk)
    want = ref_masks(batch, seqs, qls, stride, blk, 0.7)
    assert torch.equal(masks[0][0], want[0][0]) and torch.equal(masks[1][1], want[1][1])
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        hm, sink=4, window=16, out=out, xa_block_idx=idx, xa_block_cnt=cnt, xattn_block=blk,
        block_m=64, block_n=16,
    )  # fmt: skip
    ref = hybrid_attention_ref(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        hm, 4, 16, xa_block_masks=masks, xa_block=blk,
    )  # fmt: skip
    assert_close(out, ref, "xa-e2e")


def test_list_helpers_round_trip():
    gen = torch.Generator().manual_seed(0)
    seqs, qls, blk = [100, 64], [60, 64], 16
    masks = []
    for s in seqs:
        nb = -(-s // blk)
        m = (torch.rand(2, nb, nb, generator=gen) < 0.5) & torch.tril(torch.ones(nb, nb, dtype=torch.bool))
        masks.append(m)
    mq, mk = xattn_max_blocks(max(qls), max(seqs), blk)
    idx, cnt = block_masks_to_lists(masks, seqs, qls, blk, mq, mk, 2)
    back = lists_to_block_masks(idx, cnt, seqs, qls, blk)
    for b, (s, q) in enumerate(zip(seqs, qls)):
        lo = (s - q) // blk
        assert torch.equal(back[b][:, lo:], masks[b][:, lo:])
        assert not back[b][:, :lo].any()


def test_xattn_select_errors_name_the_argument():
    batch = make_paged_batch([40], [40], 4, 2, 16, block_size=16)
    hm = torch.full((1, 2), XA, dtype=torch.int8)
    a = (batch.q, batch.key_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, hm)
    with pytest.raises(ValueError, match="block"):
        xattn_select(*a, max_q_blocks=2, max_k_blocks=2, stride=16, block=40)
    with pytest.raises(ValueError, match="block/stride"):
        xattn_select(*a, max_q_blocks=2, max_k_blocks=2, stride=8, block=48)
    with pytest.raises(ValueError, match="threshold"):
        xattn_select(*a, max_q_blocks=2, max_k_blocks=2, threshold=0.0)
    with pytest.raises(ValueError, match="max_q_blocks"):
        xattn_select(*a, max_q_blocks=0, max_k_blocks=2)


def test_one_compiled_variant_serves_every_length(monkeypatch):
    """The selection kernel is launched with the same compile-time constants at every sequence length, and
    the ints that change with the lengths (list and scratch strides) are not specialised, so the engine
    compiles it once. (A sort sized by the next power of two of the key blocks: a
    recompile in the engine at each new power of two: the demo model's first FA-XA requests at 2K / 4K / 7.8K took
    4.59 / 1.37 / 1.51 s in e2e-vllm-h200-demo.json, 0.06 s after this change in e2e-vllm-h200-demo-fused-glue.json.)"""
    import elastic_vllm.ops.xattn_select.kernel as xs
    from elastic_vllm.ops.prefill.kernel import _prefill_kernel

    real, seen = xs._xattn_select_kernel, []

    class Spy:  # records the constexpr keywords, then launches the real kernel
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append(kw)
                return real[grid](*args, **kw)

            return run

    monkeypatch.setattr(xs, "_xattn_select_kernel", Spy())
    for s in (40, 300, 700):
        batch = make_paged_batch([s], [min(s, 64)], 4, 2, 16, block_size=16, generator=torch.Generator().manual_seed(s))
        hm = torch.full((1, 2), XA, dtype=torch.int8)
        idx, cnt = select(batch, hm, [s], [min(s, 64)], 8, 32, 0.9)
        want = ref_masks(batch, [s], [min(s, 64)], 8, 32, 0.9)
        assert torch.equal(lists_to_block_masks(idx, cnt, [s], [min(s, 64)], 32)[0], want[0])
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2], seen
    strides = {"s_xi0", "s_xi1", "s_xi2", "s_xc0", "s_xc1"}
    assert strides | {"s_mass"} <= no_specialize(real)
    assert strides | {"n_tiles"} <= no_specialize(_prefill_kernel)


def no_specialize(kernel) -> set[str]:
    """The do_not_specialize names of a Triton kernel, compiled (JITFunction) or interpreted."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # TRITON_INTERPRET=1: the decorator's keywords are kept as they were given
        names = kernel.kwargs["do_not_specialize"]
    return set(names)
