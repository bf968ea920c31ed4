"""Reference hybrid attention in plain PyTorch: the oracle every kernel is tested against.

Obviously right over fast: one request, one KV head at a time, an explicit boolean mask,
float32 (or float64) softmax. Reads K/V from a vLLM-layout paged cache through block tables.

Layouts (vLLM's words)::

    q            [T, Hq, D]          packed query tokens of all requests (varlen)
    key_cache    [num_blocks, block_size, Hkv, D]
    value_cache  [num_blocks, block_size, Hkv, D]
    block_table  [B, max_blocks]     int, block ids of each request's sequence
    query_start_loc [B+1]            request b's queries are q[qsl[b]:qsl[b+1]]
    seq_lens     [B]                 tokens of request b in the cache, this step's included
    head_modes   [B, Hkv]            HeadMode per (request, KV head): FA / SSA / XA

The queries of request b are its LAST q_len tokens: positions seq_len-q_len .. seq_len-1
(a decode row has q_len 1; a chunked-prefill row starts at any offset).

Masks, for query position i and key position j (all causal: j <= i)::

    FA : every j <= i
    SSA: j < sink  or  i - j < window            (sink tokens + sliding window)
    XA : block_mask[i // xa_block, j // xa_block] (selected key blocks per query block)
"""

from __future__ import annotations

import torch

from elastic_vllm.config import HeadMode
from elastic_vllm.reference.mask import visible


def gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous [seq_len, H, D] view of one request's tokens in a paged cache."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def hybrid_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    head_modes: torch.Tensor,
    sink: int,
    window: int,
    scale: float | None = None,
    xa_block_masks: list[torch.Tensor | None] | None = None,
    xa_block: int = 128,
    compute_dtype: torch.dtype = torch.float32,
    chunk: int | None = None,
    softmax_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Hybrid FA/SSA/XA attention over a paged KV cache. Returns [T, Hq, D] in q's dtype.

    xa_block_masks[b] is a bool [Hkv, num_q_blocks, num_k_blocks] over ABSOLUTE block indices
    (block = position // xa_block) for requests with any XA head, else None. ``chunk``: queries by chunks of that
    many rows, each over the keys up to its last query (memory for 32K+ prompts). Inputs and probabilities x values in
    ``compute_dtype``; scores and softmax in ``softmax_dtype`` (default: ``compute_dtype``).
    """
    _T, Hq, D = q.shape
    Hkv = key_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    sd = compute_dtype if softmax_dtype is None else softmax_dtype
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        seq_len = int(seq_lens[b])
        k = gather_paged(key_cache, block_table[b], seq_len).to(compute_dtype)
        v = gather_paged(value_cache, block_table[b], seq_len).to(compute_dtype)
        k_pos = torch.arange(seq_len, device=q.device)
        for h in range(Hkv):
            mode = int(head_modes[b, h])
            bm = None
            if mode == HeadMode.XA:
                if xa_block_masks is None or xa_block_masks[b] is None:
                    raise ValueError(f"request {b} head {h} is XA but has no block mask")
                bm = xa_block_masks[b][h]
            for c0 in range(s, e, chunk or e - s):
                c1 = min(c0 + (chunk or e - s), e)
                q_pos = torch.arange(seq_len - (e - c0), seq_len - (e - c1), device=q.device)
                hi = int(q_pos[-1]) + 1  # causal: no key past the chunk's last query
                mask = visible(mode, q_pos, k_pos[:hi], sink, window, bm, xa_block)  # [Q, K]
                qh = q[c0:c1, h * group : (h + 1) * group].to(compute_dtype)  # [Q, G, D]
                scores = torch.einsum("qgd,kd->gqk", qh, k[:hi, h]).to(sd) * scale
                scores = scores.masked_fill(~mask, float("-inf"))
                p = torch.softmax(scores, dim=-1).to(compute_dtype)
                o = torch.einsum("gqk,kd->qgd", p, v[:hi, h])
                out[c0:c1, h * group : (h + 1) * group] = o.to(q.dtype)
    return out


def hybrid_attention_chunked(*args, chunk: int = 2048, **kwargs) -> torch.Tensor:
    """``hybrid_attention_ref`` (same arguments) by 2048-query chunks with float32 scores and softmax: fits 32K+
    prompts on one GPU. ``compute_dtype=q.dtype`` gives "PyTorch in the kernel's dtype", the baseline of the
    flash-attention rule."""
    return hybrid_attention_ref(*args, chunk=chunk, softmax_dtype=torch.float32, **kwargs)


def write_paged(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, Hkv, D] at slots (slot = block * block_size + offset), as vLLM does."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    key_cache[slots // block_size, slots % block_size] = k.to(key_cache.dtype)
    value_cache[slots // block_size, slots % block_size] = v.to(value_cache.dtype)


def dense_paged_attention(q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, max_query_len,
                          max_seq_len, scale):  # fmt: skip
    """Full causal attention with the call signature of the backend's dense kernel (``compat.flash_attn_dense``):
    the reference with every head FA, written into ``out``; a row of 0 keys gets 0, as FlashAttention writes.
    Stands in for vLLM's FlashAttention where there is none (the CPU tests of the dense dispatch)."""
    modes = torch.zeros(seq_lens.shape[0], key_cache.shape[2], dtype=torch.int8, device=q.device)
    live = seq_lens > 0
    q_lens = query_start_loc.diff()
    o = hybrid_attention_ref(q, key_cache, value_cache, block_table, query_start_loc,
                             torch.where(live, seq_lens, q_lens), modes, 0, 1 << 30, scale=scale)  # fmt: skip
    rows = torch.repeat_interleave(live, q_lens.long(), output_size=q.shape[0])
    return out.copy_(torch.where(rows[:, None, None], o, torch.zeros_like(o)))
