"""The attention seam of the vLLM backend: one call per layer, PyTorch or Triton.

Both implementations compute what ``elastic_vllm.reference.attention.hybrid_attention_ref`` computes
(same masks, same per-(request, KV head) modes), over the paged cache views of ``compat.split_kv_cache``::

    q            [T, Hq, D]          this step's queries, rows packed by query_start_loc
    key_cache    [num_blocks, block_size, Hkv, D]   (strided view; head dim contiguous)
    value_cache  [num_blocks, block_size, Hkv, D]
    block_table  [B, max_blocks] int32
    query_start_loc [B+1] int32, seq_lens [B] int32
    head_modes   [B, Hkv] int32      HeadMode FA=0 / SSA=1 / XA=2 of each row at this layer

- ``torch``: the CPU path (and a GPU fallback only when asked for): per row, keys gathered from the
  cache, SDPA with a bottom-right causal mask for FA heads, a restricted key range (sink + window,
  query tiles) for SSA heads, the reference XAttention selection for XA heads. An SSA head whose
  sequence fits in the window is exactly FA and runs with the FA heads.
- ``triton``: ``elastic_vllm.ops`` kernels (one-launch hybrid prefill over the paged cache with
  per-(request, KV head) modes, XAttention selection, split-KV decode; the fused router in
  ``routing.TritonRouter``). Selected with ``ELASTIC_VLLM_OPS=triton`` or
  ``--additional-config '{"elastic_ops": "triton"}'``; the default ``auto`` is triton on CUDA and
  torch elsewhere. On a CPU it runs under TRITON_INTERPRET=1 (tests only: slow).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elastic_vllm import ops as kernels
from elastic_vllm.config import HeadMode
from elastic_vllm.ops.xattn_select.naive import xattn_block_mask_ref
from elastic_vllm.reference.mask import ssa_keep

if kernels.AVAILABLE:  # the one check: ops=torch runs without Triton
    from elastic_vllm.ops.decode import kernel as decode_kernel
    from elastic_vllm.ops.prefill import kernel as prefill_kernel
    from elastic_vllm.ops.xattn_select import kernel as xattn_kernel

OPS_CHOICES = ("auto", "torch", "triton")
OPS_ENV = "ELASTIC_VLLM_OPS"


@dataclass(frozen=True)
class AttnParams:
    scale: float
    sink: int
    window: int
    xattn_stride: int
    xattn_block: int
    xattn_threshold: float


# (row, kv_head, first query position, last query position + 1, block mask [nb, nb]) of an XA head
XaSink = Callable[[int, int, int, int, torch.Tensor], None]
# a dense varlen kernel over the paged cache, compat.flash_attn_dense's signature:
# fn(q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, max_query_len, max_seq_len, scale)
DenseFn = Callable[..., torch.Tensor]


def resolve_ops(requested: str | None, device: torch.device) -> str:
    """'torch' or 'triton' for this engine (errors name the option)."""
    if requested is not None and not isinstance(requested, str):  # e.g. {"elastic_ops": 1} in --additional-config
        raise ValueError(f"elastic_ops / {OPS_ENV}: must be one of {', '.join(OPS_CHOICES)} (got {requested!r})")
    name = (requested or os.environ.get(OPS_ENV) or "auto").lower()
    if name not in OPS_CHOICES:
        raise ValueError(f"elastic_ops / {OPS_ENV}: must be one of {', '.join(OPS_CHOICES)} (got {name!r})")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


# --- PyTorch -------------------------------------------------------------------------------------
def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, H, D] contiguous copy of one request's tokens in a paged cache."""
    block_size = cache.shape[1]
    n = (seq_len + block_size - 1) // block_size
    return cache.index_select(0, blocks[:n].long()).flatten(0, 1)[:seq_len]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal=False):
    """q [Q, Hq', D], k/v [S, Hk', D] (Hq' multiple of Hk', grouped) -> [Q, Hq', D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _fa(q, k, v, q0: int, scale: float) -> torch.Tensor:
    Q, S = q.shape[0], k.shape[0]
    if Q == S:
        return _sdpa(q, k, v, None, scale, causal=True)
    if Q == 1:  # the last position sees every key
        return _sdpa(q, k, v, None, scale)
    qpos = torch.arange(q0, q0 + Q, device=q.device)
    mask = torch.arange(S, device=q.device)[None, :] <= qpos[:, None]
    return _sdpa(q, k, v, mask, scale)


def _ssa(q, k, v, q0: int, sink: int, window: int, scale: float) -> torch.Tensor:
    """Streaming attention; query tiles read only the sink and the keys of their window."""
    Q = q.shape[0]
    out = torch.empty_like(q)
    tile = max(256, window)
    for a in range(0, Q, tile):
        b = min(Q, a + tile)
        pa, pb = q0 + a, q0 + b
        lo = max(0, pa - window + 1)
        kpos = torch.cat([torch.arange(min(sink, lo)), torch.arange(lo, pb)]).to(q.device)
        i = torch.arange(pa, pb, device=q.device)[:, None]
        j = kpos[None, :]
        mask = (j <= i) & ssa_keep(i, j, sink, window)
        out[a:b] = _sdpa(q[a:b], k.index_select(0, kpos), v.index_select(0, kpos), mask, scale)
    return out


def _xa(q, k, v, q0: int, mask_blocks: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    Q, S = q.shape[0], k.shape[0]
    qpos = torch.arange(q0, q0 + Q, device=q.device)
    kpos = torch.arange(S, device=q.device)
    mask = (kpos[None, :] <= qpos[:, None]) & mask_blocks[(qpos // block)[:, None], (kpos // block)[None, :]]
    return _sdpa(q, k, v, mask, scale)


def torch_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    head_modes: torch.Tensor,
    p: AttnParams,
    out: torch.Tensor,
    xa_sink: XaSink | None = None,
) -> torch.Tensor:
    """Hybrid FA/SSA/XA attention, one request row at a time. Writes and returns ``out`` [T, Hq, D]."""
    Hq, Hkv = q.shape[1], key_cache.shape[2]
    group = Hq // Hkv
    modes_host = head_modes.tolist()
    for b in range(len(query_start_loc) - 1):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        S = seq_lens[b]
        q0 = S - (e - s)
        k = _gather(key_cache, block_table[b], S)
        v = _gather(value_cache, block_table[b], S)
        qb = q[s:e]
        by_mode: dict[int, list[int]] = {}
        for h, m in enumerate(modes_host[b]):
            if m == HeadMode.SSA and S <= p.window:  # every causal pair is inside the window
                m = HeadMode.FA
            by_mode.setdefault(int(m), []).append(h)
        for mode, heads in by_mode.items():
            if mode == HeadMode.XA:
                for h in heads:
                    qh = qb[:, h * group : (h + 1) * group]
                    blocks = xattn_block_mask_ref(
                        qh, k[:, h], q0, p.xattn_stride, p.xattn_block, p.xattn_threshold, p.scale
                    )
                    if xa_sink is not None:
                        xa_sink(b, h, q0, S, blocks)
                    o = _xa(qh, k[:, h : h + 1], v[:, h : h + 1], q0, blocks, p.xattn_block, p.scale)
                    out[s:e, h * group : (h + 1) * group] = o.to(out.dtype)
                continue
            qidx = torch.tensor([h * group + g for h in heads for g in range(group)], device=q.device)
            hidx = torch.tensor(heads, device=q.device)
            qh, kh, vh = qb.index_select(1, qidx), k.index_select(1, hidx), v.index_select(1, hidx)
            if mode == HeadMode.FA:
                o = _fa(qh, kh, vh, q0, p.scale)
            elif mode == HeadMode.SSA:
                o = _ssa(qh, kh, vh, q0, p.sink, p.window, p.scale)
            else:
                raise ValueError(f"unknown head mode {mode}")
            out[s:e].index_copy_(1, qidx, o.to(out.dtype))
    return out


# --- Triton -----------------------------------------------------------------------------------
def triton_kernels():
    """The kernel modules (prefill, decode, xattn_select); a RuntimeError naming the problem where they cannot
    load."""
    kernels.require("ops=triton (ELASTIC_VLLM_OPS=torch runs without them)")
    return prefill_kernel, decode_kernel, xattn_kernel


def triton_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    head_modes: torch.Tensor,
    p: AttnParams,
    out: torch.Tensor,
    num_decodes: int,
    num_decode_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    uses_xattn: bool = False,
    prefill_query_start_loc: torch.Tensor | None = None,
    fa_heads: DenseFn | None = None,
) -> torch.Tensor:
    """Single-token rows (the first ``num_decodes``: the builder has vLLM put them first) go to the
    split-KV decode kernel (``decode.decode_attention``; XA heads read every key there), the other
    rows to the one-launch hybrid prefill (``prefill.prefill_attention``), with XAttention block
    selection (``xattn_select.xattn_select``) first when the mode has XA heads. No host sync: every
    argument is a device tensor or a host int fixed at build time (CUDA-graph safe for decodes).

    ``fa_heads`` (vLLM's FlashAttention, ``compat.flash_attn_dense``): the prompt rows' FA heads run
    through it instead, see :func:`fa_heads_attention`; the hybrid prefill then runs the other heads."""
    prefill, decode, xsel = triton_kernels()
    B = seq_lens.shape[0]
    if num_decodes:
        decode.decode_attention(
            q[:num_decode_tokens],
            key_cache,
            value_cache,
            block_table[:num_decodes],
            seq_lens[:num_decodes],
            head_modes[:num_decodes],
            sink=p.sink,
            window=p.window,
            max_seq_len=max_seq_len,
            scale=p.scale,
            out=out[:num_decode_tokens],
        )
    if num_decodes < B:
        qp, bt = q[num_decode_tokens:], block_table[num_decodes:]
        qsl = prefill_query_start_loc
        if qsl is None:
            qsl = query_start_loc[num_decodes:] - num_decode_tokens
        sl, hm = seq_lens[num_decodes:], head_modes[num_decodes:]
        xa_idx = xa_cnt = None
        if uses_xattn:
            mq, mk = xsel.xattn_max_blocks(max_query_len, max_seq_len, p.xattn_block)
            xa_idx, xa_cnt = xsel.xattn_select(
                qp, key_cache, bt, qsl, sl, hm, max_q_blocks=mq, max_k_blocks=mk,
                stride=p.xattn_stride, block=p.xattn_block, threshold=p.xattn_threshold, scale=p.scale,
            )  # fmt: skip
        op = out[num_decode_tokens:]
        if fa_heads is not None:
            fa_heads_attention(fa_heads, qp, key_cache, value_cache, op, qsl, sl, bt, hm, max_query_len,
                               max_seq_len, p.scale)  # fmt: skip
        prefill.prefill_attention(
            qp, key_cache, value_cache, bt, qsl, sl, hm, sink=p.sink, window=p.window, scale=p.scale,
            out=op, xa_block_idx=xa_idx, xa_block_cnt=xa_cnt, xattn_block=p.xattn_block,
            skip_fa=fa_heads is not None,
        )  # fmt: skip
    return out


def fa_heads_attention(
    fn: DenseFn,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    head_modes: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Full causal attention of the FA heads of prompt rows through a dense varlen kernel ``fn``, one call
    per KV head h over strided views (no copy): queries ``q[:, hG:(h+1)G]``, the cache's head h, output
    ``out[:, hG:(h+1)G]``. A row whose head h is not FA gets 0 keys (``seqused_k``) in that call, so the call
    does no work for it; what it writes there is overwritten by the hybrid prefill (``skip_fa``), which runs
    after it and computes exactly the heads that are not FA. No host sync: the per-head key counts are one
    device op over ``head_modes``.

    Why per KV head: the routing differs per (request, head) and is decided on the device at this layer,
    while a dense kernel runs one set of heads for every row; Hkv calls of G query heads each cover every
    (row, head) pair, and each call still fills the GPU on the long prompts it is used for."""
    hkv = key_cache.shape[2]
    g = q.shape[1] // hkv
    # .contiguous(): the where keeps the transposed layout of head_modes.t(), so a row of it is strided over
    # B and FA3 rejects it ("seqused_k must be contiguous", H100, any step of 2+ prompt rows)
    fa_lens = torch.where(head_modes.t() == int(HeadMode.FA), seq_lens, 0).to(torch.int32).contiguous()  # [Hkv, B]
    for h in range(hkv):
        qs = slice(h * g, (h + 1) * g)
        fn(q[:, qs], key_cache[:, :, h : h + 1], value_cache[:, :, h : h + 1], out[:, qs], query_start_loc,
           fa_lens[h], block_table, max_query_len, max_seq_len, scale)  # fmt: skip
    return out
