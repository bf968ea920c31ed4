"""The plain-PyTorch reference of ``kernel.decode_attention``: one query per request (its last token), the
paged-cache oracle of ``elastic_vllm.reference.attention`` over its keys; XA heads read every key, as the kernel's
do at decode. Float32 inside, q's dtype out."""

from __future__ import annotations

import torch

from elastic_vllm.reference.attention import hybrid_attention_ref


def decode_attention_naive(q, key_cache, value_cache, block_table, seq_lens, head_modes, *, sink, window, scale=None):
    """[B, Hq, D] (shapes: ``kernel.decode_attention``)."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    modes = torch.where(head_modes == 2, torch.zeros_like(head_modes), head_modes)  # XA (2) -> FA (0) at decode
    return hybrid_attention_ref(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, modes, sink,
                                window, scale)  # fmt: skip
