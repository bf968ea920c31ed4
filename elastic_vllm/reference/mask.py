"""Which keys a query sees, per head mode: the one definition of the masks. The references, the transformers
integration's torch path and the vLLM backend's torch path build their masks here; the Triton kernels compute the
same predicate tile by tile (and are tested against the references). For query position i and key position j::

    FA : every j <= i
    SSA: j < sink  or  i - j < window            (sink tokens + sliding window)
    XA : block_mask[i // xa_block, j // xa_block] (selected key blocks per query block)
"""

from __future__ import annotations

import torch

from elastic_vllm.config import HeadMode


def ssa_keep(i: torch.Tensor, j: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """The SSA keys of queries ``i`` (broadcast against keys ``j``): a sink token or inside the window; causality
    is not included."""
    return (j < sink) | (i - j < window)


def visible(
    mode: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sink: int,
    window: int,
    block_mask: torch.Tensor | None = None,
    xa_block: int = 128,
) -> torch.Tensor:
    """Boolean [Q, K] mask of the key positions each query position may attend to."""
    i = q_pos[:, None]
    j = k_pos[None, :]
    causal = j <= i
    if mode == HeadMode.FA:
        return causal
    if mode == HeadMode.SSA:
        return causal & ssa_keep(i, j, sink, window)
    if mode == HeadMode.XA:
        if block_mask is None:
            raise ValueError("XA head needs a block mask")
        qb = (q_pos // xa_block).long()
        kb = (k_pos // xa_block).long()
        return causal & block_mask[qb[:, None], kb[None, :]].bool()
    raise ValueError(f"unknown head mode {mode}")
