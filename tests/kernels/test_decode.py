"""Split-KV hybrid decode kernel (elastic_vllm/ops/decode/kernel.py) against the reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import zlib

import pytest
import torch
from kutils import assert_close, no_host_sync, random_modes, strided_caches
from testlib import nan_like

from elastic_vllm.config import HeadMode
from elastic_vllm.ops.decode.kernel import decode_attention, decode_num_splits
from elastic_vllm.reference.attention import hybrid_attention_ref
from elastic_vllm.reference.paged import make_paged_batch

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)


def ref(batch, modes, sink, window):
    # decode treats XA as FA (documented project decision)
    m = torch.where(modes == XA, torch.full_like(modes, FA), modes)
    return hybrid_attention_ref(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, m, sink, window,
    )  # fmt: skip


def run(batch, modes, sink, window, **kw):
    out = nan_like(batch.q)
    kw.setdefault("max_seq_len", int(batch.seq_lens.max()))
    ret = decode_attention(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, modes,
        sink=sink, window=window, out=out, **kw,
    )  # fmt: skip
    assert ret is out
    return out


# name: (seq_lens, Hq, Hkv, D, block_size, sink, window, modes, num_splits, block_n)
CASES = {
    "ragged_gqa1": ([1, 63, 113, 1023], 2, 2, 32, 16, 4, 40, (FA, SSA), None, 32),
    "gqa3_one_split": ([63, 113], 6, 2, 16, 16, 3, 20, (FA, SSA), 1, 16),
    "gqa4_many_splits": ([1023, 200, 17], 8, 2, 16, 16, 8, 100, (FA, SSA), 7, 32),
    "gqa8_tile_in_block": ([300, 64], 8, 1, 64, 64, 16, 50, (SSA,), 3, 32),
    "xa_decodes_as_fa": ([90, 150], 4, 2, 16, 16, 4, 10, (XA, SSA, FA), 2, 16),
    "window_1_sink_0": ([40, 41], 4, 2, 16, 16, 0, 1, (SSA,), 2, 16),
    "d24": ([50, 70], 4, 2, 24, 16, 4, 9, (FA, SSA), 2, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_reference(name):
    seqs, hq, hkv, d, bs, sink, window, modes, ns, bn = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    batch = make_paged_batch(seqs, [1] * len(seqs), hq, hkv, d, block_size=bs, generator=gen)
    hm = random_modes(len(seqs), hkv, modes, gen)
    out = run(batch, hm, sink, window, num_splits=ns, block_n=bn)
    assert_close(out, ref(batch, hm, sink, window), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_dtypes_strided_cache_slots(dtype):
    gen = torch.Generator().manual_seed(4)
    batch = make_paged_batch([100, 37, 260], [1, 1, 1], 8, 2, 32, block_size=16, dtype=dtype, generator=gen)
    kc, vc = strided_caches(batch)
    hm = torch.tensor([[FA, SSA], [SSA, SSA], [SSA, FA]], dtype=torch.int8)
    table = torch.full((6, 2, 2), 7, dtype=torch.int32)
    slots = torch.tensor([5, 1, 2], dtype=torch.int32)
    table[slots.long(), 0] = hm.int()
    out = nan_like(batch.q)
    decode_attention(
        batch.q, kc, vc, batch.block_table, batch.seq_lens, table[:, 0], sink=4, window=30, max_seq_len=512,
        out=out, head_mode_slots=slots, block_n=16,
    )  # fmt: skip
    assert_close(out, ref(batch, hm, 4, 30), str(dtype))


def test_decode_padded_rows_and_loose_max_seq_len():
    """CUDA-graph padding: seq_len 0 rows give zeros; max_seq_len may exceed every seq_len."""
    gen = torch.Generator().manual_seed(2)
    batch = make_paged_batch([50, 1, 80], [1, 1, 1], 4, 2, 16, block_size=16, generator=gen)
    hm = torch.tensor([[FA, SSA], [FA, FA], [SSA, FA]], dtype=torch.int8)
    want = ref(batch, hm, 2, 9)
    batch.seq_lens[1] = 0
    out = run(batch, hm, 2, 9, max_seq_len=4096, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], want[[0, 2]], "padded")


def test_decode_balanced_splits_under_a_loose_bound():
    """Graphs captured for a long max_seq_len: each (request, head) spreads the tiles it reads over all
    splits (>= min tiles each), so short requests and SSA heads use several short splits, and splits
    past a head's last tile exit; the merge must give the reference for every layout."""
    gen = torch.Generator().manual_seed(11)
    batch = make_paged_batch([700, 33, 260, 5], [1] * 4, 8, 4, 16, block_size=16, generator=gen)
    hm = random_modes(4, 4, (FA, SSA), gen)
    want = ref(batch, hm, 8, 100)
    for ns in (5, 16, 64):
        out = run(batch, hm, 8, 100, max_seq_len=8192, num_splits=ns, block_n=16)
        assert_close(out, want, f"num_splits={ns}")


def test_decode_mixed_modes_padded_row_slots_and_splits():
    """Mixed FA / XA / SSA heads, a padded row (seq_len 0), a slot table and many splits: every (request, head)
    pair is run exactly once (a pair run twice or never leaves NaN-poisoned or wrong rows)."""
    gen = torch.Generator().manual_seed(21)
    batch = make_paged_batch([300, 40, 1, 190, 77], [1] * 5, 8, 4, 16, block_size=16, generator=gen)
    hm = random_modes(5, 4, (FA, SSA, SSA, XA), gen)
    want = ref(batch, hm, 4, 30)
    batch.seq_lens[2] = 0
    table = torch.full((9, 3, 4), 5, dtype=torch.int8)
    slots = torch.tensor([7, 0, 3, 8, 2], dtype=torch.int32)
    table[slots.long(), 1] = hm
    out = nan_like(batch.q)
    decode_attention(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, table[:, 1], sink=4,
        window=30, max_seq_len=512, out=out, head_mode_slots=slots, num_splits=6, block_n=16,
    )  # fmt: skip
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    keep = [0, 1, 3, 4]
    assert_close(out[keep], want[keep], "mixed-modes")


def test_decode_num_splits_fills_the_gpu():
    # many splits for one long request, one split when the batch alone fills the SMs
    assert decode_num_splits(1, 8, 131072, 64, torch.device("cpu")) > 1
    assert decode_num_splits(64, 8, 1024, 64, torch.device("cpu")) == 1


def test_decode_no_host_sync():
    gen = torch.Generator().manual_seed(1)
    batch = make_paged_batch([30, 200], [1, 1], 4, 2, 16, block_size=16, generator=gen)
    hm = torch.tensor([[FA, SSA], [SSA, FA]], dtype=torch.int8)
    with no_host_sync():
        out = decode_attention(
            batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, hm,
            sink=2, window=6, max_seq_len=256, num_splits=3, block_n=16,
        )  # fmt: skip
    assert_close(out, ref(batch, hm, 2, 6), "no-sync")


def test_decode_launcher_errors_name_the_argument():
    batch = make_paged_batch([20, 5], [1, 1], 4, 2, 16, block_size=16)
    hm = torch.zeros(2, 2, dtype=torch.int8)
    args = (batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens)
    with pytest.raises(ValueError, match="max_seq_len"):
        decode_attention(*args, hm, sink=1, window=2, max_seq_len=torch.tensor(20))
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(*args[:4], torch.zeros(3, dtype=torch.int32), hm, sink=1, window=2, max_seq_len=20)
    with pytest.raises(ValueError, match="head_mode_slots"):
        decode_attention(*args, hm, sink=1, window=2, max_seq_len=20, head_mode_slots=torch.zeros(3))
    with pytest.raises(ValueError, match="q: head_dim"):
        decode_attention(torch.zeros(2, 4, 8), *args[1:], hm, sink=1, window=2, max_seq_len=20)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(*args, hm, sink=1, window=2, max_seq_len=20, num_splits=-1)


def test_decode_num_splits_on_an_h200_sized_gpu(monkeypatch):
    """The split counts chosen for 132 SMs at the e2e decode shapes (measured in the kernel benchmark's
    decode_splits section): ~32 programs per SM, at most one split per SM per (request, head)."""
    from elastic_vllm.ops.decode import kernel as decode

    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    assert decode.decode_num_splits(16, 8, 32768, 64, dev) == 33  # 32K x 16
    assert decode.decode_num_splits(4, 8, 131072, 64, dev) == 132  # 128K x 4
    assert decode.decode_num_splits(1, 8, 131072, 64, dev) == 132  # one request: one split per SM
    assert decode.decode_num_splits(64, 8, 32768, 64, dev) == 9
    assert decode.decode_num_splits(1, 8, 2048, 64, dev) == 4  # >= 8 key tiles per split
