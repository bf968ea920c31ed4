"""The reference hybrid attention equals dense SDPA with an explicit, independently built mask."""

import pytest
import torch
import torch.nn.functional as F

from elastic_vllm.config import HeadMode
from elastic_vllm.reference.attention import hybrid_attention_ref, write_paged
from elastic_vllm.reference.paged import make_paged_batch

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)


def paged(batch):
    """The paged batch as the reference's first six arguments."""
    return batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens


def loop_mask(mode, q_start, q_len, seq_len, sink, window, bm=None, blk=128):
    """Mask built element by element, independent of the code under test."""
    m = torch.zeros(q_len, seq_len, dtype=torch.bool)
    for qi in range(q_len):
        i = q_start + qi
        for j in range(seq_len):
            if j > i:
                continue
            if mode == FA:
                ok = True
            elif mode == SSA:
                ok = j < sink or i - j < window
            else:
                ok = bool(bm[i // blk, j // blk])
            m[qi, j] = ok
    return m


def sdpa_oracle(batch, modes, sink, window, xa_masks=None, blk=128):
    out = torch.full_like(batch.q, float("nan"))
    Hq, Hkv = batch.q.shape[1], batch.key_cache.shape[2]
    g = Hq // Hkv
    qsl = batch.query_start_loc.tolist()
    for b in range(batch.num_reqs):
        s, e = qsl[b], qsl[b + 1]
        S = int(batch.seq_lens[b])
        for h in range(Hkv):
            bm = xa_masks[b][h] if (xa_masks and xa_masks[b] is not None) else None
            mask = loop_mask(int(modes[b, h]), S - (e - s), e - s, S, sink, window, bm, blk)
            q = batch.q[s:e, h * g : (h + 1) * g].transpose(0, 1).double()
            k = batch.keys[b][:, h].double().expand(g, -1, -1)
            v = batch.values[b][:, h].double().expand(g, -1, -1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(g, -1, -1))
            out[s:e, h * g : (h + 1) * g] = o.transpose(0, 1).to(out.dtype)
    return out


SCENARIOS = {
    # name: (seq_lens, query_lens)
    "single_prefill": ([37], [37]),
    "varlen_prefill": ([1, 63, 113], [1, 63, 113]),
    "chunked_prefill": ([70, 90], [20, 33]),  # queries start at offsets 50 and 57
    "pure_decode": ([5, 64, 129], [1, 1, 1]),
    "mixed": ([100, 17, 60], [1, 17, 12]),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("gqa", [(4, 2), (3, 3), (8, 1)])
def test_reference_matches_sdpa(scenario, gqa):
    seq_lens, q_lens = SCENARIOS[scenario]
    Hq, Hkv = gqa
    batch = make_paged_batch(seq_lens, q_lens, Hq, Hkv, 16, block_size=8, dtype=torch.float64)
    B = len(seq_lens)
    modes = torch.randint(0, 3, (B, Hkv))
    modes[0, 0] = XA  # every scenario exercises XA
    blk = 16
    xa_masks = []
    for S in seq_lens:
        nb = (S + blk - 1) // blk
        m = torch.rand(Hkv, nb, nb) < 0.4
        idx = torch.arange(nb)
        m[:, idx, idx] = True  # diagonal kept so every query sees a key
        xa_masks.append(m)
    sink, window = 3, 10
    out = hybrid_attention_ref(
        *paged(batch),
        modes,
        sink,
        window,
        xa_block_masks=xa_masks,
        xa_block=blk,
        compute_dtype=torch.float64,
    )
    want = sdpa_oracle(batch, modes, sink, window, xa_masks, blk)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


def test_modes_differ_when_they_should():
    """SSA with a window shorter than the context must not equal FA (the mask is really applied)."""
    batch = make_paged_batch([64], [64], 2, 1, 8, block_size=8)
    args = (batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    fa = hybrid_attention_ref(*args, torch.tensor([[FA]]), 2, 8)
    ssa = hybrid_attention_ref(*args, torch.tensor([[SSA]]), 2, 8)
    assert torch.equal(fa[:10], ssa[:10])  # inside window: identical
    assert (fa[20:] - ssa[20:]).abs().max() > 1e-3


def test_window_covering_everything_equals_fa():
    batch = make_paged_batch([50, 30], [50, 7], 4, 2, 8, block_size=4)
    args = (batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    fa = hybrid_attention_ref(*args, torch.full((2, 2), FA), 0, 1)
    ssa = hybrid_attention_ref(*args, torch.full((2, 2), SSA), 0, 50)
    torch.testing.assert_close(fa, ssa)


def test_write_paged_round_trip():
    batch = make_paged_batch([20], [20], 2, 2, 8, block_size=4)
    kc, vc = torch.zeros_like(batch.key_cache), torch.zeros_like(batch.value_cache)
    bt = batch.block_table[0].long()
    pos = torch.arange(20)
    slots = bt[pos // 4] * 4 + pos % 4
    write_paged(kc, vc, batch.keys[0], batch.values[0], slots)
    assert torch.equal(kc[bt[:5]], batch.key_cache[bt[:5]])


def test_xa_without_mask_is_an_error():
    batch = make_paged_batch([8], [8], 2, 1, 8, block_size=4)
    with pytest.raises(ValueError, match="no block mask"):
        hybrid_attention_ref(
            *paged(batch),
            torch.tensor([[XA]]),
            2,
            4,
        )
