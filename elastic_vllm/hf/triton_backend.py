"""GPU inference path of the transformers engine: the Triton kernels of ``elastic_vllm.csrc``.

transformers' DynamicCache holds K/V as [B, Hkv, K, D]; the kernels read vLLM's paged layout
[num_blocks, block_size, Hkv, D]. A row's contiguous real tokens ARE such a cache with one block of
``block_size = K`` (a strided view, no copy; the kernels take any strides with D contiguous), so:

- unpadded prefill: ONE ``prefill_attention`` launch for the whole batch (block b = row b);
- padded rows and decode steps: one launch per row over the view of its real tokens.

XA blocks come from the same selection as the torch path (``ops.xa_block_masks``), converted to the
kernel's block lists. Training never comes here (the kernels have no backward).
"""

from __future__ import annotations

import torch

from elastic_vllm.config import ElasticConfig, HeadMode


def available() -> bool:
    try:
        import triton  # noqa: F401

        from elastic_vllm.csrc import decode, prefill  # noqa: F401
    except ImportError:
        return False
    return True


def _row_span(valid: torch.Tensor) -> tuple[int, int]:
    idx = valid.nonzero().squeeze(1)
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    if hi - lo != idx.numel():
        raise ValueError("the triton path needs each row's real tokens to be contiguous (left or right padding)")
    return lo, hi


def _xa_lists(xa, b: int, hkv: int, seq_len: int, q_len: int, cfg: ElasticConfig, device, row: int = 0):
    from elastic_vllm.csrc.xattn_select import block_masks_to_lists, xattn_max_blocks

    nb = -(-seq_len // cfg.xattn_block)
    masks = torch.stack([xa.get((b, h), torch.zeros(nb, nb, dtype=torch.bool)).cpu() for h in range(hkv)])
    mq, mk = xattn_max_blocks(q_len, seq_len, cfg.xattn_block)
    return block_masks_to_lists([masks], [seq_len], [q_len], cfg.xattn_block, mq, mk, hkv, device)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    modes: torch.Tensor,
    k_valid: torch.Tensor,
    q_valid: torch.Tensor,
    padded: bool,
    xa: dict,
    cfg: ElasticConfig,
    scale: float,
) -> torch.Tensor:
    """Each (row, KV head) in its HeadMode. q [B, Hq, Q, D], k/v [B, Hkv, K, D] -> [B, Hq, Q, D]."""
    from elastic_vllm.csrc.decode import decode_attention
    from elastic_vllm.csrc.prefill import prefill_attention

    B, Hq, Q, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    dev = q.device
    modes = modes.to(device=dev, dtype=torch.int32)
    has_xa = bool((modes == HeadMode.XA).any())
    if not padded and Q == K and not has_xa:
        qp = q.transpose(1, 2).reshape(B * Q, Hq, D)
        out = prefill_attention(
            qp,
            k.transpose(1, 2),
            v.transpose(1, 2),
            torch.arange(B, device=dev, dtype=torch.int32)[:, None],
            torch.arange(B + 1, device=dev, dtype=torch.int32) * Q,
            torch.full((B,), K, device=dev, dtype=torch.int32),
            modes,
            sink=cfg.sink,
            window=cfg.window,
            scale=scale,
        )
        return out.view(B, Q, Hq, D).transpose(1, 2)
    out = q.new_zeros(B, Hq, Q, D)
    one = torch.zeros(1, 1, device=dev, dtype=torch.int32)
    for b in range(B):
        lo, hi = _row_span(k_valid[b])
        qidx = q_valid[b].nonzero().squeeze(1)
        if qidx.numel() == 0:
            continue
        kb = k[b : b + 1, :, lo:hi].transpose(1, 2)  # [1, Kr, Hkv, D] view
        vb = v[b : b + 1, :, lo:hi].transpose(1, 2)
        qb = q[b].index_select(1, qidx).transpose(0, 1).contiguous()  # [Qr, Hq, D]
        Kr, Qr = hi - lo, qidx.numel()
        seq = torch.tensor([Kr], device=dev, dtype=torch.int32)
        if Qr == 1:
            o = decode_attention(
                qb, kb, vb, one, seq, modes[b : b + 1], sink=cfg.sink, window=cfg.window, max_seq_len=Kr, scale=scale
            )
        else:
            kw = {}
            if bool((modes[b] == HeadMode.XA).any()):
                idx, cnt = _xa_lists(xa, b, Hkv, Kr, Qr, cfg, dev)
                kw = {"xa_block_idx": idx, "xa_block_cnt": cnt, "xattn_block": cfg.xattn_block}
            o = prefill_attention(
                qb,
                kb,
                vb,
                one,
                torch.tensor([0, Qr], device=dev, dtype=torch.int32),
                seq,
                modes[b : b + 1],
                sink=cfg.sink,
                window=cfg.window,
                scale=scale,
                **kw,
            )
        out[b, :, qidx] = o.transpose(0, 1)
    return out
