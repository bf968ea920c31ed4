"""The plain-PyTorch reference of ``kernel.prefill_attention``: the paged-cache oracle of
``elastic_vllm.reference.attention`` with the launcher's arguments (XA heads take their block masks, the form
``xattn_select.kernel.lists_to_block_masks`` gives the kernel's block lists). Float32 inside, q's dtype out."""

from __future__ import annotations

from elastic_vllm.reference.attention import hybrid_attention_ref


def prefill_attention_naive(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, head_modes, *, sink,
                            window, scale=None, xa_block_masks=None, xattn_block=128):  # fmt: skip
    """[T, Hq, D]: request b's queries are its last q_len tokens (shapes: ``kernel.prefill_attention``)."""
    return hybrid_attention_ref(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, head_modes, sink,
                                window, scale, xa_block_masks, xattn_block)  # fmt: skip
