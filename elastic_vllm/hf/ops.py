"""Attention math of the transformers integration, in plain PyTorch (CPU and GPU).

Layouts are transformers' own: q [B, Hq, Q, D], k / v [B, Hkv, K, D] (post-RoPE, the K keys include
the cache), GQA group G = Hq // Hkv (query head h reads KV head h // G). Positions are counted over
each row's REAL tokens (a left-padded row's first real token has position 0), so sink and window mean
the same thing with or without padding, and the same thing as in the vLLM engine.

Masks (key j visible to query i, all causal j <= i), as ``elastic_vllm.reference.attention``::

    FA : every j <= i
    SSA: j < sink  or  i - j < window
    XA : block_mask[i // block, j // block]

Three paths:
- ``causal_attention``: dense causal SDPA (flash on GPU);
- ``ssa_attention_banded``: SSA without a T x T mask. Queries go in blocks of ``window``; block b reads
  the sink keys plus keys [(b-1)W, (b+1)W), so the work is T * (sink + 2W) instead of T^2 / 2, and it
  is differentiable (it is the training path): at T = 8K, W = 512, S = 128 that is 3.5x less than FA.
- ``masked_attention``: any per-(row, KV head) boolean mask (padding, XA, decode); T^2 memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.ops.xattn_select.naive import xattn_block_mask_ref
from elastic_vllm.reference.mask import ssa_keep


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n, T, D] (query head h reads KV head h // n)."""
    if n == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)


def token_positions(padding_mask: torch.Tensor | None, batch: int, length: int, device) -> tuple:
    """Positions [B, K] over real tokens and validity [B, K] of the K keys of a forward.

    ``padding_mask`` is transformers' 2D attention mask (1 = real token) over past + new tokens.
    Padding keys get the position of the previous real token and valid = False.
    """
    if padding_mask is None:
        pos = torch.arange(length, device=device).expand(batch, length)
        return pos, torch.ones(batch, length, dtype=torch.bool, device=device)
    m = padding_mask.to(device=device, dtype=torch.bool)
    if m.shape[1] < length:
        raise ValueError(
            f"attention mask covers {m.shape[1]} tokens but the layer sees {length} keys; the elastic "
            "attention supports transformers' DynamicCache (the default of generate())"
        )
    m = m[:, -length:]
    return m.long().cumsum(1) - 1, m


def ssa_pattern(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[B, Q, K] bool: key is a sink token or inside the window (causality not included)."""
    return ssa_keep(q_pos[:, :, None], k_pos[:, None, :], sink, window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention, queries are the last Q of the K keys. -> [B, Hq, Q, D]."""
    G = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, G), repeat_kv(v, G)
    Q, K = q.shape[2], k.shape[2]
    if Q == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if Q == K:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    i = torch.arange(K - Q, K, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(K, device=q.device)[None] <= i, scale=scale)


def ssa_attention_banded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: int, window: int, scale: float
) -> torch.Tensor:
    """SSA prefill of unpadded rows (queries = keys = positions 0..T-1). -> [B, Hq, T, D].

    Query block b (positions [bW, bW + W)) reads::

        sink slots   p in [0, S)           visible iff p < (b-1)W        (else the window slot has it)
        window slots p in [(b-1)W, (b+1)W) visible iff 0 <= p <= i and (i - p < W or p < S)

    so no key is counted twice and every query sees at least itself.
    """
    B, Hq, T, D = q.shape
    if T <= window:  # every causal key is inside the window: SSA == FA
        return causal_attention(q, k, v, scale)
    G = Hq // k.shape[1]
    k, v = repeat_kv(k, G), repeat_kv(v, G)
    W, S = window, min(sink, T)
    nb = math.ceil(T / W)
    pad = nb * W - T
    dev = q.device
    qb = F.pad(q, (0, 0, 0, pad)).view(B, Hq, nb, W, D)
    # keys padded W in front (positions -W..-1) and up to nb*W behind; block b's window = [bW, bW + 2W)
    kp = F.pad(k, (0, 0, W, pad))
    vp = F.pad(v, (0, 0, W, pad))
    kw = kp.unfold(2, 2 * W, W).transpose(-1, -2)  # [B, Hq, nb, 2W, D]
    vw = vp.unfold(2, 2 * W, W).transpose(-1, -2)
    ks = k[:, :, None, :S].expand(B, Hq, nb, S, D)
    vs = v[:, :, None, :S].expand(B, Hq, nb, S, D)
    kc = torch.cat([ks, kw], dim=3)  # [B, Hq, nb, S + 2W, D]
    vc = torch.cat([vs, vw], dim=3)
    # blocks go to the batch dimension: [B * nb, Hq, ...] with the mask broadcast over heads
    qf = qb.transpose(1, 2).reshape(B * nb, Hq, W, D)
    kf = kc.transpose(1, 2).reshape(B * nb, Hq, S + 2 * W, D)
    vf = vc.transpose(1, 2).reshape(B * nb, Hq, S + 2 * W, D)
    mf = _banded_mask(nb, W, S, dev, B)  # [B * nb, 1, W, S + 2W]
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mf, scale=scale)  # [B*nb, Hq, W, D]
    return o.view(B, nb, Hq, W, D).transpose(1, 2).reshape(B, Hq, nb * W, D)[:, :, :T]


_BANDED_MASKS: dict[tuple, torch.Tensor] = {}


def _banded_mask(nb: int, W: int, S: int, dev: torch.device, rows: int = 1) -> torch.Tensor:
    """The visibility of ``ssa_attention_banded``, [rows * nb, 1, W, S + 2W] (block b of every row has the
    same); every layer of a forward shares it (cached: ~10 fewer kernel launches per layer, which is
    what bounds a 135M model's step time)."""
    key = (nb, W, S, str(dev), rows)
    m = _BANDED_MASKS.get(key)
    if m is None:
        b_idx = torch.arange(nb, device=dev)[:, None, None]
        i = b_idx * W + torch.arange(W, device=dev)[None, :, None]  # [nb, W, 1] query positions
        p_sink = torch.arange(S, device=dev)[None, None, :]
        p_win = (b_idx - 1) * W + torch.arange(2 * W, device=dev)[None, None, :]  # [nb, 1, 2W]
        m_sink = (p_sink < (b_idx - 1) * W).expand(nb, W, S)
        m_win = (p_win >= 0) & (p_win <= i) & ((i - p_win < W) | (p_win < S))
        m = torch.cat([m_sink, m_win], dim=2)
        m = m[None].expand(rows, nb, W, S + 2 * W).reshape(rows * nb, 1, W, S + 2 * W).contiguous()
        if len(_BANDED_MASKS) >= 16:
            _BANDED_MASKS.clear()
        _BANDED_MASKS[key] = m
    return m


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention under a per-(row, KV head) mask [B, Hkv, Q, K]. -> [B, Hq, Q, D].

    Rows with no visible key (padding queries) attend to every key instead: their output is finite
    garbage that no real token reads (a NaN there would leak through 0 * NaN in later layers).
    """
    B, Hq, Q, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    mask = mask | ~mask.any(-1, keepdim=True)
    qg = q.reshape(B, Hkv, G * Q, D)
    mg = mask[:, :, None].expand(B, Hkv, G, Q, mask.shape[-1]).reshape(B, Hkv, G * Q, -1)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mg, scale=scale)
    return o.reshape(B, Hq, Q, D)  # SDPA on CUDA may return a permuted layout


def mix_heads(o_fa: torch.Tensor, o_sa: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """out = r_fa * O_fa + r_sa * O_sa per KV head. o_* [B, Hq, T, D], r [B, Hkv, 2] (index 1 = FA).

    Mixed in float32 (then cast back): the router's gradient sum(g * (O_fa - O_sa)) over T x D
    elements would lose most of its bits in bf16.
    """
    G = o_fa.shape[1] // r.shape[1]
    r = r.float().repeat_interleave(G, dim=1)[:, :, None, None, :]  # [B, Hq, 1, 1, 2]
    return (r[..., 1] * o_fa.float() + r[..., 0] * o_sa.float()).to(o_fa.dtype)


def xa_block_masks(
    q: torch.Tensor,
    k: torch.Tensor,
    valid: torch.Tensor,
    wanted: torch.Tensor,
    cfg: ElasticConfig,
    scale: float,
) -> dict[tuple[int, int], torch.Tensor]:
    """XAttention block selection at prefill for the (row, KV head) pairs in ``wanted`` [B, Hkv].

    q [B, Hq, T, D], k [B, Hkv, T, D], valid [B, T]. Blocks are over each row's real-token positions.
    Returns {(b, h): bool [nb, nb]}. Runs the plain reference selection: the GPU selection kernel
    plugs in here (``elastic_vllm.ops``) once it exists.
    """
    out: dict[tuple[int, int], torch.Tensor] = {}
    if not bool(wanted.any()):
        return out
    G = q.shape[1] // k.shape[1]
    for b, h in wanted.nonzero().tolist():
        idx = valid[b].nonzero().squeeze(1)
        qh = q[b, h * G : (h + 1) * G].index_select(1, idx).transpose(0, 1).detach()  # [T, G, D]
        kh = k[b, h].index_select(0, idx).detach()  # [T, D]
        out[(b, h)] = xattn_block_mask_ref(
            qh, kh, 0, stride=cfg.xattn_stride, block=cfg.xattn_block, threshold=cfg.xattn_threshold, scale=scale
        )
    return out


def head_masks(
    modes: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    cfg: ElasticConfig,
    xa: dict[tuple[int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """bool [B, Hkv, Q, K] from per-(row, head) HeadMode ``modes`` [B, Hkv]."""
    base = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]  # [B, Q, K]
    ssa = ssa_pattern(q_pos, k_pos, cfg.sink, cfg.window)
    is_ssa = (modes == HeadMode.SSA)[:, :, None, None]
    mask = base[:, None] & (~is_ssa | ssa[:, None])
    for (b, h), bm in (xa or {}).items():
        if int(modes[b, h]) != HeadMode.XA:
            continue
        blk = cfg.xattn_block
        qb = q_pos[b].clamp(min=0) // blk
        kb = k_pos[b].clamp(min=0) // blk
        mask[b, h] &= bm.to(mask.device)[qb[:, None], kb[None, :]]
    return mask
