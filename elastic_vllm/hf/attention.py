"""The ``elastic`` attention function, registered in transformers' AttentionInterface.

transformers calls it from every attention layer with post-RoPE q [B, Hq, Q, D] and k, v
[B, Hkv, K, D] (K includes the cache). It:

1. at prefill (no past keys): routes each request row from the PRE-RoPE keys its layer computed
   (captured by a hook on ``k_norm`` or ``k_proj``), pooled over that row's own prompt tokens;
   records the decision in ``ElasticState``;
2. at decode: reuses the row's prefill decision (``decode_mode`` says what SA heads do now);
3. computes each KV head in its mode (FA / SSA / XA) — or, when training, BOTH the FA-side and the
   SA-side output of every head, mixed by the straight-through Gumbel-softmax routing.
"""

from __future__ import annotations

import torch

import elastic_vllm.hf.ops as ops  # the module, not the package: hf/__init__ imports this one
from elastic_vllm.config import HeadMode
from elastic_vllm.hf.state import ElasticState
from elastic_vllm.reference.attention import hybrid_attention_ref
from elastic_vllm.router.model import budget_sa_counts
from elastic_vllm.router.policy import FORCE_CODE, decode_modes, head_modes, route_heads

ATTN_IMPLEMENTATION = "elastic"


def pool_prompt_keys(
    keys: torch.Tensor, prompt: torch.Tensor, pooling: str, n: int, check: bool = True
) -> torch.Tensor:
    """keys [B, T, Hkv, D], prompt [B, T] bool (the row's prompt tokens) -> pooled [B, Hkv, D] float32.

    Per row, the same pooling as ``router.model.pool_keys`` ("boundary": mean over the first and last
    ``n`` prompt tokens, none counted twice; "whole": mean over all), as one differentiable einsum.
    """
    count = prompt.sum(1, keepdim=True)
    if check and bool((count == 0).any()):  # a host sync: the trainer checks its prompt lengths itself
        raise ValueError("cannot route a request with an empty prompt")
    if pooling == "whole":
        sel = prompt
    elif pooling == "boundary":
        rank = prompt.long().cumsum(1) - 1
        sel = prompt & ((rank < n) | (rank >= count - n))
    else:
        raise ValueError(f"unknown pooling {pooling!r}")
    w = sel.float() / sel.sum(1, keepdim=True).float().clamp(min=1.0)
    return torch.einsum("bt,bthd->bhd", w, keys.float())


def gumbel_straight_through(logits: torch.Tensor, noise: torch.Tensor | None, tau: float) -> torch.Tensor:
    """r = r_hard + r_soft - r_soft.detach(), r_soft = softmax((z + g) / tau). [..., 2], index 1 = FA."""
    z = logits if noise is None else logits + noise.to(logits)
    soft = torch.softmax(z / tau, dim=-1)
    # ties -> index 0 (SA), as decide(); no F.one_hot: it checks its input on the host (2 GPU syncs a layer)
    hard = (soft.argmax(-1, keepdim=True) == torch.arange(2, device=soft.device)).to(soft.dtype)
    return hard + (soft - soft.detach())  # exactly hard in the forward


def _route(state: ElasticState, module, layer: int, k_pos: torch.Tensor, k_valid: torch.Tensor, B: int):
    """Decide every (row, KV head) of this layer at prefill. Returns (is_fa [B, Hkv], r or None)."""
    cfg = state.cfg
    dev = k_valid.device
    logits = None
    if state.router is not None:
        keys = getattr(module, "_elastic_keys", None)
        if keys is None or keys.shape[:2] != (B, k_valid.shape[1]):
            raise RuntimeError(
                f"layer {layer}: no pre-RoPE keys captured for this forward (got "
                f"{None if keys is None else tuple(keys.shape)}); was enable_elastic() called on this model?"
            )
        prompt = k_valid
        if state.train is not None:
            prompt = prompt & (k_pos < state.train.prompt_lens.to(dev)[:, None])
        pooled = pool_prompt_keys(keys, prompt, cfg.pooling, cfg.pool_tokens, check=state.train is None)
        logits = state.router(layer, pooled)  # [B, Hkv, 2] float32
        state.num_router_calls += 1
    r = None
    if state.train is not None:
        if logits is None:
            raise RuntimeError("training needs a router")
        noise = None if state.train.gumbel is None else state.train.gumbel[:, layer]
        r = gumbel_straight_through(logits, noise, state.train.tau)
        state.train.r[layer] = r
        state.train.logits[layer] = logits
        is_fa = r[..., 1].detach() > 0.5
    elif state.fixed_routing is not None and cfg.force == "auto":  # an experiment's own decisions
        fixed = state.fixed_routing.to(dev).bool()
        is_fa = (fixed[layer] if fixed.dim() == 2 else fixed[:, layer]).expand(B, -1)
    else:
        if logits is None and cfg.force == "auto":
            raise RuntimeError("elastic attention with force='auto' needs a router (or state.fixed_routing)")
        budget = None
        if logits is not None and cfg.target_omega is not None:
            n_sa = budget_sa_counts(cfg.target_omega, state.num_layers, 0, 1, state.num_kv_heads)[layer]
            budget = torch.full((B,), n_sa, dtype=torch.long, device=dev)
        force = cfg.force if logits is not None else torch.full((B,), FORCE_CODE[cfg.force], device=dev)
        floor = None if state.floor is None else state.floor[layer].to(dev)
        is_fa = route_heads(
            logits, cfg, num_heads=state.num_kv_heads, force=force, bias=cfg.bias, budget=budget, floor=floor
        ).fa
    state.record(layer, is_fa, logits)
    return is_fa, r


def _reference(q, k, v, modes, k_valid, q_valid, xa, cfg, scale) -> torch.Tensor:
    """Per row, the plain oracle ``hybrid_attention_ref`` over the row's real tokens. -> [B, Hq, Q, D]."""
    B, Hq, Q, D = q.shape
    Hkv = k.shape[1]
    out = q.new_zeros(B, Hq, Q, D)
    for b in range(B):
        kidx = k_valid[b].nonzero().squeeze(1)
        qidx = q_valid[b].nonzero().squeeze(1)
        if qidx.numel() == 0:
            continue
        kb = k[b].index_select(1, kidx).transpose(0, 1)  # [Kr, Hkv, D]
        vb = v[b].index_select(1, kidx).transpose(0, 1)
        qb = q[b].index_select(1, qidx).transpose(0, 1)  # [Qr, Hq, D]
        masks = None
        if bool((modes[b] == HeadMode.XA).any()):
            nb = -(-kidx.numel() // cfg.xattn_block)
            masks = [
                torch.stack(
                    [xa.get((b, h), torch.zeros(nb, nb, dtype=torch.bool, device=q.device)) for h in range(Hkv)]
                )
            ]
        o = hybrid_attention_ref(
            qb,
            kb[None],
            vb[None],
            torch.zeros(1, 1, dtype=torch.long, device=q.device),
            torch.tensor([0, qidx.numel()], device=q.device),
            torch.tensor([kidx.numel()], device=q.device),
            modes[b : b + 1],
            cfg.sink,
            cfg.window,
            scale=scale,
            xa_block_masks=masks,
            xa_block=cfg.xattn_block,
        )
        out[b, :, qidx] = o.transpose(0, 1)
    return out


def _attend_all(mode: int, q, k, v, ctx, cfg, scale, xa) -> torch.Tensor:
    """Output if every head ran ``mode`` (the training path computes two of these and mixes them)."""
    k_pos, k_valid, q_pos, q_valid, padded, impl = ctx
    B, Hkv = q.shape[0], k.shape[1]
    modes = torch.full((B, Hkv), int(mode), dtype=torch.long, device=q.device)
    if impl == "reference":
        return _reference(q, k, v, modes, k_valid, q_valid, xa, cfg, scale)
    prefill = q.shape[2] == k.shape[2]
    if not padded and mode == HeadMode.FA:
        return ops.causal_attention(q, k, v, scale)
    if not padded and prefill and mode == HeadMode.SSA:
        return ops.ssa_attention_banded(q, k, v, cfg.sink, cfg.window, scale)
    return ops.masked_attention(q, k, v, ops.head_masks(modes, q_pos, k_pos, k_valid, cfg, xa), scale)


def elastic_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    state: ElasticState | None = getattr(module, "_elastic_state", None)
    if state is None:
        raise RuntimeError(
            "attn_implementation='elastic' needs elastic_vllm.hf.enable_elastic(model, cfg, router) "
            "(or elastic_vllm.hf.load_elastic_model) before the first forward"
        )
    if sliding_window is not None:
        raise NotImplementedError("elastic attention does not support sliding-window layers")
    if dropout:
        raise NotImplementedError("elastic attention has no attention dropout")
    cfg = state.cfg
    layer = int(module.layer_idx)
    B, _, Q, D = query.shape
    K = key.shape[2]
    scale = D**-0.5 if scaling is None else scaling
    dev = query.device
    k_pos, k_valid = ops.token_positions(state.padding_mask, B, K, dev)
    q_pos, q_valid = k_pos[:, K - Q :], k_valid[:, K - Q :]
    padded = state.padding_mask is not None
    ctx = (k_pos, k_valid, q_pos, q_valid, padded, state.impl)
    prefill = Q == K
    fa_mode, sa_mode = cfg.fa_mode, cfg.sa_mode

    if prefill:
        if not state.in_prefill:
            raise RuntimeError("elastic attention saw a prefill the model-level hook did not announce")
        is_fa, r = _route(state, module, layer, k_pos, k_valid, B)
        xa: dict = {}
        if cfg.uses_xattn:
            want = is_fa if fa_mode == HeadMode.XA else ~is_fa
            if r is not None:  # training computes both sides for every head
                want = torch.ones_like(is_fa)
            xa = ops.xa_block_masks(query, key, k_valid, want, cfg, scale)
            state.xa_masks.update({(b, layer, h): m for (b, h), m in xa.items()})
        if r is not None:
            o_fa = _attend_all(fa_mode, query, key, value, ctx, cfg, scale, xa)
            o_sa = o_fa if _sa_equals_fa(cfg, K) else _attend_all(sa_mode, query, key, value, ctx, cfg, scale, xa)
            out = ops.mix_heads(o_fa, o_sa, r)
        else:
            modes = torch.where(is_fa, int(fa_mode), int(sa_mode)).long()
            out = _compute(modes, query, key, value, ctx, cfg, scale, xa)
    else:
        if state.routing is None or state.routing.shape[0] != B:
            raise RuntimeError(
                f"decode step with batch {B} but the last prefill routed "
                f"{None if state.routing is None else state.routing.shape[0]} rows; prefill the prompts through "
                "this elastic model in one forward first"
            )
        cached = state.decode_cache.get(layer)
        if cached is None or cached[0].device != dev:
            modes = decode_modes(head_modes(state.routing[:, layer].to(dev), cfg), cfg.decode_mode).long()
            cached = state.decode_cache[layer] = (modes, frozenset(modes.unique().tolist()))
        out = _compute(cached[0], query, key, value, ctx, cfg, scale, {}, cached[1])
    return out.transpose(1, 2).contiguous(), None


def _sa_equals_fa(cfg, length: int) -> bool:
    """SSA equals FA while every causal key is inside the window (then O_sa = O_fa, no second pass)."""
    return cfg.mode == "FA-SSA" and length <= cfg.window


def _compute(modes, q, k, v, ctx, cfg, scale, xa, present: frozenset | None = None) -> torch.Tensor:
    """Inference: each (row, KV head) in its HeadMode. -> [B, Hq, Q, D].

    ``present``: the set of modes in ``modes`` if known (saves a host sync).
    """
    k_pos, k_valid, q_pos, q_valid, padded, impl = ctx
    if impl == "reference":
        return _reference(q, k, v, modes, k_valid, q_valid, xa, cfg, scale)
    if impl == "triton":
        import elastic_vllm.hf.triton_backend as triton_backend

        return triton_backend.hybrid_attention(q, k, v, modes, k_valid, q_valid, padded, xa, cfg, scale)
    present = set(modes.unique().tolist()) if present is None else set(present)
    if len(present) == 1:
        return _attend_all(present.pop(), q, k, v, ctx, cfg, scale, xa)
    if not padded and q.shape[2] == k.shape[2] and present == {int(HeadMode.FA), int(HeadMode.SSA)}:
        # two cheap passes (flash + banded SSA) beat one pass under a T x T mask
        o_fa = ops.causal_attention(q, k, v, scale)
        o_sa = ops.ssa_attention_banded(q, k, v, cfg.sink, cfg.window, scale)
        is_fa = (modes == HeadMode.FA)[..., None]
        return ops.mix_heads(o_fa, o_sa, torch.cat([~is_fa, is_fa], -1).float())
    return ops.masked_attention(q, k, v, ops.head_masks(modes, q_pos, k_pos, k_valid, cfg, xa), scale)
