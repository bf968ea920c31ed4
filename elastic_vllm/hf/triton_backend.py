"""GPU inference path of the transformers engine: the Triton kernels of ``elastic_vllm.ops``.

transformers' DynamicCache holds K/V as [B, Hkv, K, D]; the kernels read vLLM's paged layout
[num_blocks, block_size, Hkv, D] through a block table. The whole batch IS such a cache with
``block_size = 1``: token t of row b sits ``b * row_stride + t`` token strides from the start (a strided
view, no copy; the kernels take any strides with D contiguous), so every row's real tokens are a block
list, wherever its padding is. Hence:

- one launch per layer for the whole batch, prefill or decode, padded or not (no per-row loop, no host
  sync besides one check that each row's real tokens are contiguous);
- a padded prefill row is split into requests: leading padding, the real tokens, trailing padding (the
  padding requests attend among padding tokens; their outputs are zeroed);
- the block size is the same 1 for every length, so the kernels compile once per shape class, not once
  per sequence length (with ``block_size = K``, a compile-time constant of the kernels, every decode step
  compiled new kernels: more than 12x slower per prompt than the torch path on the H200,
  benchmarks/results/experiments/accuracy-5-h200-triton-impl-partial).

XA blocks come from the same selection as the torch path (``ops.xa_block_masks``), converted to the
kernel's block lists. Training never comes here (the kernels have no backward).
"""

from __future__ import annotations

import torch

from elastic_vllm import ops as kernels
from elastic_vllm.config import ElasticConfig, HeadMode

if kernels.AVAILABLE:  # the one check: impl="torch" runs without Triton
    from elastic_vllm.ops.decode import kernel as decode_kernel
    from elastic_vllm.ops.prefill import kernel as prefill_kernel
    from elastic_vllm.ops.xattn_select import kernel as xattn_kernel


def available() -> bool:
    """Whether the kernels load here (``elastic_vllm.ops.AVAILABLE``)."""
    return kernels.AVAILABLE


def token_blocks(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[B, Hkv, K, D] keys and values -> ([N, 1, Hkv, D] key and value views, row stride in tokens).

    Block ``b * row_stride + t`` is token t of row b. Views when both tensors have the same layout with
    a batch stride that is a multiple of the token stride (transformers' caches: contiguous, or the
    projection's transposed layout); otherwise contiguous copies of both.
    """
    if not _same_token_layout(k, v):
        k, v = k.contiguous(), v.contiguous()
    B, H, K, D = k.shape
    sb, sh, st, _ = k.stride()
    rows = sb // st
    n = (B - 1) * rows + K
    if n >= 2**31:
        raise ValueError(f"{n} token blocks exceed the kernels' int32 block ids")
    return k.as_strided((n, 1, H, D), (st, st, sh, 1)), v.as_strided((n, 1, H, D), (st, st, sh, 1)), rows


def _same_token_layout(k: torch.Tensor, v: torch.Tensor) -> bool:
    sb, _sh, st, sd = k.stride()
    return k.stride() == v.stride() and sd == 1 and st > 0 and sb % st == 0


def row_spans(k_valid: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first real key [B], number of real keys [B]) of each row, int32 on the device.

    Raises ValueError unless each row's real tokens are contiguous and, when the step has fewer queries
    than keys (decode, or a continued prompt), end at the last key and include every query. One host sync
    (the check).
    """
    K = k_valid.shape[1]
    n = k_valid.sum(1)
    if q_len < K:  # new tokens are appended: real tokens [K - n, K)
        lo = K - n
    else:
        lo = torch.where(n > 0, k_valid.int().argmax(1), 0)
    ar = torch.arange(K, device=k_valid.device)
    expect = (ar >= lo[:, None]) & (ar < (lo + n)[:, None])
    bad = (expect != k_valid).any(1)
    if q_len < K:
        bad = bad | (n < q_len)
    if bool(bad.any()):
        b = int(bad.int().argmax())
        row = k_valid[b].nonzero().flatten().tolist()
        where = f"end at the last key and cover the {q_len} new tokens" if q_len < K else "be contiguous"
        raise ValueError(
            f"the triton path needs each row's real tokens to {where} (left padding for generation; left or "
            f"right padding for a prompt); row {b} of the attention mask has {len(row)} real tokens of {K}, at "
            f"{_runs(row)}"
        )
    return lo.to(torch.int32), n.to(torch.int32)


def _runs(idx: list[int]) -> str:
    """[0, 1, 2, 7, 8] -> "0-2, 7-8"."""
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else str(x))
            start = None
    return ", ".join(out) or "none"


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
    """Each (row, KV head) in its HeadMode. q [B, Hq, Q, D], k/v [B, Hkv, K, D] -> [B, Hq, Q, D].

    Outputs at padding queries are 0 (the torch path leaves them unspecified; nothing reads them).
    """
    B, Hq, Q, D = q.shape
    K = k.shape[2]
    dev = q.device
    if Q > K:
        raise ValueError(f"the triton path needs at most as many queries as keys, got {Q} queries, {K} keys")
    modes = modes.to(device=dev, dtype=torch.int32)
    kc, vc, rows = token_blocks(k, v)
    if padded:
        lo, n = row_spans(k_valid, Q)
    else:
        lo = torch.zeros(B, device=dev, dtype=torch.int32)
        n = torch.full((B,), K, device=dev, dtype=torch.int32)
    base = torch.arange(B, device=dev, dtype=torch.int32) * rows
    ar = torch.arange(K, device=dev, dtype=torch.int32)
    if Q < K:
        # new tokens at the end of every row, after its real past (left padding): one request per row
        bt = (base + lo)[:, None] + ar[None, :]
        if Q == 1:
            o = decode_kernel.decode_attention(
                q[:, :, 0], kc, vc, bt, n, modes, sink=cfg.sink, window=cfg.window, max_seq_len=K, scale=scale
            )
            out = o[:, :, None]
        else:
            qp = q.transpose(1, 2).reshape(B * Q, Hq, D)
            qsl = torch.arange(B + 1, device=dev, dtype=torch.int32) * Q
            o = prefill_kernel.prefill_attention(
                qp, kc, vc, bt, qsl, n, modes, sink=cfg.sink, window=cfg.window, scale=scale
            )
            out = o.view(B, Q, Hq, D).transpose(1, 2)
        return out  # row_spans checked that every new token is real: no padding queries to zero
    # prefill (Q == K): per row the requests [leading padding, real tokens, trailing padding]; a request of
    # 0 tokens owns no queries (its programs exit)
    if padded:
        lens = torch.stack([lo, n, K - lo - n], 1)  # [B, 3]
        starts = torch.stack([torch.zeros_like(lo), lo, lo + n], 1)
        req_modes = torch.zeros(B, 3, modes.shape[1], device=dev, dtype=torch.int32)
        req_modes[:, 1] = modes
        lens, starts, req_modes = lens.reshape(-1), starts.reshape(-1), req_modes.reshape(3 * B, -1)
        req_base = base.repeat_interleave(3)
    else:
        lens, starts, req_modes, req_base = n, lo, modes, base
    R = lens.shape[0]
    qsl = torch.zeros(R + 1, device=dev, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    bt = (req_base + starts)[:, None] + ar[None, :]
    kw = {}
    if cfg.uses_xattn and bool((modes == HeadMode.XA).any()):  # FA-SSA: no host sync here
        kw = _xa_kwargs(xa, n, padded, R, modes.shape[1], cfg, dev)
    qp = q.transpose(1, 2).reshape(B * K, Hq, D)
    o = prefill_kernel.prefill_attention(
        qp, kc, vc, bt, qsl, lens, req_modes, sink=cfg.sink, window=cfg.window, scale=scale, **kw
    )
    out = o.view(B, K, Hq, D).transpose(1, 2)
    return torch.where(q_valid[:, None, :, None], out, 0.0) if padded else out


def _xa_kwargs(xa, n, padded: bool, R: int, hkv: int, cfg: ElasticConfig, dev) -> dict:
    """XA block lists for the prefill requests: row b's selection on its real-token request (3b + 1 when
    padded, else b), none elsewhere. One host sync (the row lengths)."""
    n_host = n.tolist()
    masks: list[torch.Tensor | None] = [None] * R
    seq = [0] * R
    for b, nb_tok in enumerate(n_host):
        r = 3 * b + 1 if padded else b
        nb = -(-nb_tok // cfg.xattn_block)
        masks[r] = torch.stack([xa.get((b, h), torch.zeros(nb, nb, dtype=torch.bool)).cpu() for h in range(hkv)])
        seq[r] = nb_tok
    mq, mk = xattn_kernel.xattn_max_blocks(max(seq), max(seq), cfg.xattn_block)
    idx, cnt = xattn_kernel.block_masks_to_lists(masks, seq, seq, cfg.xattn_block, mq, mk, hkv, dev)
    return {"xa_block_idx": idx, "xa_block_cnt": cnt, "xattn_block": cfg.xattn_block}
