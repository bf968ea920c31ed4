"""Each operator's naive.py against its kernel (TRITON_INTERPRET=1): the references the kernel folders carry are the
ones the kernels meet, on a ragged batch with every head mode (prefill: chunked rows and a decode row; decode: XA
heads read every key, as the kernel's do)."""

from __future__ import annotations

import torch
from kutils import assert_close, random_modes
from testlib import nan_like

from elastic_vllm.ops.decode.kernel import decode_attention
from elastic_vllm.ops.decode.naive import decode_attention_naive
from elastic_vllm.ops.prefill.kernel import prefill_attention
from elastic_vllm.ops.prefill.naive import prefill_attention_naive
from elastic_vllm.reference.paged import make_paged_batch

SINK, WINDOW = 4, 24


def test_prefill_kernel_equals_its_naive_reference():
    g = torch.Generator().manual_seed(7)
    b = make_paged_batch([70, 33, 50], [70, 9, 1], 8, 2, 32, block_size=16, generator=g)
    modes = random_modes(3, 2, (0, 1), g)
    out = prefill_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens, modes,
                            sink=SINK, window=WINDOW, out=nan_like(b.q))  # fmt: skip
    ref = prefill_attention_naive(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                                  modes, sink=SINK, window=WINDOW)  # fmt: skip
    assert_close(out, ref, "prefill vs naive")


def test_decode_kernel_equals_its_naive_reference_xa_heads_dense():
    g = torch.Generator().manual_seed(8)
    b = make_paged_batch([90, 5, 41], [1, 1, 1], 8, 2, 32, block_size=16, generator=g)
    modes = random_modes(3, 2, (0, 1, 2), g)
    out = decode_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.seq_lens, modes, sink=SINK,
                           window=WINDOW, max_seq_len=90, out=nan_like(b.q))  # fmt: skip
    ref = decode_attention_naive(b.q, b.key_cache, b.value_cache, b.block_table, b.seq_lens, modes, sink=SINK,
                                 window=WINDOW)  # fmt: skip
    assert_close(out, ref, "decode vs naive")
