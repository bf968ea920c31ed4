"""Reference XAttention block selection (antidiagonal scoring + threshold), per KV head.

For each query block A and key block C (both ``block`` tokens, absolute positions):

1. Strided antidiagonal estimate at ``stride`` granularity: for query group a and key group c
   (``stride`` tokens each)::

       est[a, c] = sum_s  q[a*stride + stride-1-s] . k[c*stride + s]  / sqrt(D) / stride

   (positions outside the sequence or outside this step's queries count as zero vectors).
2. Causal at group level (c <= a), softmax over c per query group (float32).
3. Mass of (A, C) = sum of the probabilities of A's groups over C's groups, summed over the
   query heads of the KV head's group (GQA: one block list per KV head, shared by its query heads).
4. Keep, per query block, the smallest set of key blocks C <= A, largest mass first, whose mass
   reaches ``threshold`` of the row's total; the first block (sink) and the diagonal block are
   always kept.
"""

from __future__ import annotations

import math

import torch


def antidiagonal_scores(
    q: torch.Tensor, k: torch.Tensor, q_start: int, stride: int, scale: float | None = None
) -> torch.Tensor:
    """q [Q, G, D] queries at positions q_start.., k [S, D] keys at 0..S-1.

    Returns est [G, n_groups, n_groups] over absolute stride groups, n_groups = ceil(S / stride).
    """
    Q, G, D = q.shape
    S = k.shape[0]
    n = math.ceil(S / stride)
    scale = D**-0.5 if scale is None else scale
    qp = torch.zeros(n * stride, G, D, dtype=torch.float32, device=q.device)
    qp[q_start : q_start + Q] = q.float()
    kp = torch.zeros(n * stride, D, dtype=torch.float32, device=k.device)
    kp[:S] = k.float()
    # reversed order inside each query group makes the stride x stride product's antidiagonal
    q_rev = qp.view(n, stride, G, D).flip(1).permute(2, 0, 1, 3).reshape(G, n, stride * D)
    k_r = kp.view(n, stride * D)
    return torch.einsum("gae,ce->gac", q_rev, k_r) * (scale / stride)


def xattn_block_mask_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_start: int,
    stride: int = 16,
    block: int = 128,
    threshold: float = 0.9,
    scale: float | None = None,
) -> torch.Tensor:
    """Selected blocks of ONE (request, KV head). q [Q, G, D], k [S, D] -> bool [nb, nb], nb = ceil(S / block).

    Rows of query blocks with no query in this step are all False.
    """
    if block % stride:
        raise ValueError(f"block {block} must be a multiple of stride {stride}")
    Q = q.shape[0]
    S = k.shape[0]
    est = antidiagonal_scores(q, k, q_start, stride, scale)  # [G, n, n]
    n = est.shape[-1]
    gi = torch.arange(n, device=q.device)
    est = est.masked_fill(gi[None, :] > gi[:, None], float("-inf"))
    p = torch.softmax(est, dim=-1)  # [G, n, n]
    # query groups with no query of this step carry no mass
    g_lo, g_hi = q_start // stride, (q_start + Q - 1) // stride
    live = (gi >= g_lo) & (gi <= g_hi)
    p = p * live[None, :, None]
    per = block // stride
    nb = math.ceil(S / block)
    pad = nb * per - n
    p = torch.nn.functional.pad(p, (0, pad, 0, pad))
    mass = p.view(-1, nb, per, nb, per).sum(dim=(0, 2, 4))  # [nb, nb]
    mask = torch.zeros(nb, nb, dtype=torch.bool, device=q.device)
    b_lo, b_hi = q_start // block, (q_start + Q - 1) // block
    for a in range(b_lo, b_hi + 1):
        row = mass[a, : a + 1]
        order = torch.argsort(row, descending=True, stable=True)
        csum = torch.cumsum(row[order], 0)
        # keep blocks until the mass BEFORE adding a block already reaches the threshold
        need = threshold * row.sum()
        keep_n = int((csum - row[order] < need).sum().item())
        mask[a, order[: max(keep_n, 1)]] = True
        mask[a, 0] = True
        mask[a, a] = True
    return mask
