"""Omega_MSR and Omega_ESR: how sparse a request's attention was.

- Omega_MSR (model sparsity ratio): share of KV heads, over all layers, the router sent to SA.
- Omega_ESR (effective sparsity ratio): mean over KV heads of the share of the causal
  (query, key) pairs the head skips at the request's actual length: 0 for an FA head,
  1 - visible/causal for an SSA head (sink + window) or an XA head (its actual block mask).
"""

from __future__ import annotations

import torch

from elastic_vllm.config import ElasticConfig, HeadMode


def omega_msr(is_fa: torch.Tensor) -> float:
    """is_fa: bool [..., Hkv] router decisions (True = FA) for one request. Share routed to SA."""
    if is_fa.numel() == 0:
        raise ValueError("no heads")
    return float((~is_fa.bool()).float().mean())


def causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def ssa_visible_pairs(length: int, sink: int, window: int) -> int:
    """Causal (i, j) pairs with j < sink or i - j < window, for positions 0..length-1 (closed form)."""
    # query i sees min(i+1, window) window keys + min(sink, max(0, i+1-window)) sink keys
    w = min(length, window)
    in_window = w * (w + 1) // 2 + (length - w) * window  # sum_i min(i+1, window)
    # sum over i >= window of min(sink, i+1-window): t = i+1-window runs 1..length-window
    m = max(0, length - window)
    s = min(sink, m)
    in_sink = s * (s + 1) // 2 + (m - s) * sink
    return in_window + in_sink


def decode_visible_tokens(length: int, sink: int, window: int) -> int:
    """Keys an SSA head reads for the query at position length-1: j < sink or j >= length - window."""
    return min(length, min(sink, length) + min(window, length) - max(0, min(sink, length) - max(length - window, 0)))


def xa_visible_pairs(block_mask: torch.Tensor, length: int, block: int) -> int:
    """Causal pairs inside the selected blocks of a bool [nb, nb] block mask at ``length``."""
    pos = torch.arange(length, device=block_mask.device)
    nb = block_mask.shape[0]
    sizes = torch.bincount(pos // block, minlength=nb)  # tokens per block
    qb = torch.arange(nb, device=block_mask.device)
    total = 0
    # off-diagonal selected blocks (C < A): every pair visible; diagonal: causal triangle
    bm = block_mask.bool() & (qb[None, :] < qb[:, None])
    total += int((bm.long() * sizes[:, None] * sizes[None, :]).sum())
    diag = block_mask.bool().diagonal()
    total += int((diag.long() * sizes * (sizes + 1) // 2).sum())
    return total


def head_esr(
    mode: int, length: int, sink: int, window: int, block_mask: torch.Tensor | None = None, block: int = 128
) -> float:
    """Pruned share of the causal pairs of one head at ``length`` tokens."""
    if length <= 0:
        raise ValueError(f"length must be positive, got {length}")
    total = causal_pairs(length)
    if mode == HeadMode.FA:
        return 0.0
    if mode == HeadMode.SSA:
        return 1.0 - ssa_visible_pairs(length, sink, window) / total
    if mode == HeadMode.XA:
        if block_mask is None:
            raise ValueError("XA head needs its block mask")
        return 1.0 - xa_visible_pairs(block_mask, length, block) / total
    raise ValueError(f"unknown head mode {mode}")


def omega_esr(
    head_modes: torch.Tensor,
    length: int,
    cfg: ElasticConfig,
    xa_block_masks: dict[tuple[int, int], torch.Tensor] | None = None,
) -> float:
    """Mean pruned share over all heads. head_modes [L, Hkv] HeadMode of one request.

    xa_block_masks maps (layer, head) -> block mask for XA heads.
    """
    modes = head_modes.tolist()
    ssa = head_esr(HeadMode.SSA, length, cfg.sink, cfg.window)
    vals = []
    for layer, row in enumerate(modes):
        for h, m in enumerate(row):
            if m == HeadMode.FA:
                vals.append(0.0)
            elif m == HeadMode.SSA:
                vals.append(ssa)
            else:
                bm = (xa_block_masks or {}).get((layer, h))
                vals.append(head_esr(HeadMode.XA, length, cfg.sink, cfg.window, bm, cfg.xattn_block))
    return sum(vals) / len(vals)
