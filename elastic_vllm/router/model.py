"""The Attention Router (one per layer, weights shared by the KV heads of the layer).

Matches the authors' checkpoints tensor for tensor (see ``router/convert.py``)::

    keys x_K [T, H_kv, d]  (pre-RoPE, post-k_norm)
      -> pool over the first/last N prompt tokens          [H_kv, d]
      -> Task MLP   Linear(d,4d) SiLU Linear(4d,d)          [H_kv, d]
      -> Router MLP Linear(d,4d) SiLU Linear(4d,d) SiLU Linear(d,2)
      -> logits z [H_kv, 2];  decision = argmax z;  INDEX 1 = FULL ATTENTION

With d = 128 a layer has 263,682 parameters (the paper's "0.27M").

Optional (ours, not in the authors' checkpoints): a fixed per-(layer, KV head) input standardization
``x -> (x - input_shift[l, h]) * input_scale[l, h]`` before the Task MLP (buffers [L, H_kv, d],
measured on training prompts before training starts). Pooled keys of one head are dominated by a
large constant vector (|mean| ~15 against a spread of ~1.6 on SmolLM2; the robust-vs-sensitive
difference is ~1): without it AdamW moves every prompt's logits together and the decisions do not
depend on the prompt; with it a few hundred steps separate tasks. Heads share the MLP weights, so
the per-head shift cannot be folded into them.
The router runs in float32 whatever the backbone dtype: it is tiny, and the
vLLM and transformers engines must reach the same decisions.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

FA_INDEX = 1  # authors' code: logit index 1 = full attention (the paper's text says r=0)


class LayerRouter(nn.Module):
    """Router of one layer. Input [..., d] pooled keys, output [..., 2] logits."""

    def __init__(self, head_dim: int, hidden_mult: int = 4):
        super().__init__()
        d, h = head_dim, hidden_mult * head_dim
        self.cls_feat_extractor = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, d))
        self.cls_router_head_agnostic = nn.Sequential(
            nn.Linear(d, h), nn.SiLU(), nn.Linear(h, d), nn.SiLU(), nn.Linear(d, 2)
        )

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.cls_router_head_agnostic(self.cls_feat_extractor(pooled))


class ElasticRouter(nn.Module):
    """All layers' routers of one backbone.

    ``forward(layer, pooled [B, H_kv, d]) -> logits [B, H_kv, 2]`` (float32).
    """

    def __init__(self, num_layers: int, head_dim: int, hidden_mult: int = 4):
        super().__init__()
        self.num_layers = num_layers
        self.head_dim = head_dim
        self.hidden_mult = hidden_mult
        self.layers = nn.ModuleList(LayerRouter(head_dim, hidden_mult) for _ in range(num_layers))
        self.register_buffer("input_shift", None)  # set_input_norm; None = no standardization
        self.register_buffer("input_scale", None)
        # [num_layers, H_kv] float32 retrieval scores of the checkpoint (router.json "retrieval"), None without one:
        # metadata for the fail-safe floor (policy.floor_of), not a weight (kept on the host, out of the state dict)
        self.retrieval_scores: torch.Tensor | None = None

    def set_input_norm(self, shift: torch.Tensor, scale: torch.Tensor) -> None:
        """Fix the input standardization: shift, scale [num_layers, H_kv, head_dim] (finite, scale > 0)."""
        if shift.dim() != 3 or shift.shape != scale.shape or shift.shape[0] != self.num_layers:
            raise ValueError(
                f"input norm must be two [num_layers={self.num_layers}, H_kv, head_dim={self.head_dim}] tensors, "
                f"got {tuple(shift.shape)} and {tuple(scale.shape)}"
            )
        if shift.shape[2] != self.head_dim:
            raise ValueError(f"input norm head_dim {shift.shape[2]} != router head_dim {self.head_dim}")
        if not (torch.isfinite(shift).all() and torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError("input norm must be finite with scale > 0")
        dev = self.layers[0].cls_feat_extractor[0].weight.device
        self.input_shift = shift.detach().float().to(dev).contiguous()
        self.input_scale = scale.detach().float().to(dev).contiguous()

    def forward(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        if pooled.shape[-1] != self.head_dim:
            raise ValueError(
                f"router expects pooled keys with head_dim {self.head_dim}, got shape {tuple(pooled.shape)}"
            )
        x = pooled.float()
        if self.input_shift is not None:
            if x.shape[-2] != self.input_shift.shape[1]:
                raise ValueError(
                    f"router input norm is for {self.input_shift.shape[1]} KV heads, got pooled keys {tuple(x.shape)}"
                )
            x = (x - self.input_shift[layer]) * self.input_scale[layer]
        return self.layers[layer](x)

    @torch.no_grad()
    def route(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        """Hard decisions [B, H_kv] bool, True = full attention (index 1)."""
        return decide(self.forward(layer, pooled))


def decide(logits: torch.Tensor, sa_margin: float = 0.0) -> torch.Tensor:
    """True where the head runs FA: ``z_FA - z_SA > -sa_margin``, both sides float32.

    The reference of every routing path (vLLM torch glue, the Triton router kernel's epilogue, the
    transformers integration): a head goes SA only when the router prefers SA by at least ``sa_margin``
    (``ElasticConfig.sa_margin``). With 0 it is the argmax, ties going to index 0 (SA) as ``torch.argmax``
    (first maximum) does in the authors' code. A head whose logits are not finite (NaN / inf: an overflowing
    router or NaN keys) goes to FA, the mode that drops nothing (``torch.argmax`` would pick the NaN's index,
    and NaN comparisons say SA); the engine counts such heads (``elastic:router_nonfinite_heads_total``) and
    warns.
    """
    z = logits.float()
    # torch compares a float32 tensor with a Python float at float32, as the kernel receives its threshold;
    # a tensor of margins (one per row, [R, 1]: per-request biases) is float32 as well
    thr = -sa_margin.float() if isinstance(sa_margin, torch.Tensor) else -float(sa_margin)
    return ((z[..., FA_INDEX] - z[..., 1 - FA_INDEX]) > thr) | ~torch.isfinite(z).all(-1)


def effective_margin(sa_margin: float, bias: float) -> float:
    """The margin :func:`decide` applies for a routing ``bias``: FA iff ``z_FA - z_SA > bias - sa_margin``, so a
    bias > 0 sends more heads to SA (sparser), < 0 fewer (denser). Negation is exact in float64, so the float32
    threshold is the same whichever side subtracts."""
    return float(sa_margin) - float(bias)


def budget_sa_counts(
    target: float, num_layers: int, group: int = 0, num_groups: int = 1, group_heads: int = 1
) -> list[int]:
    """SA heads of each layer for a fixed budget ``target`` (the share of a request's (layer, KV head) pairs in SA),
    for head group ``group`` of ``num_groups`` (tensor parallelism: the ranks' contiguous KV-head groups of
    ``group_heads`` heads; 0 of 1 without it).

    Layers route one at a time during the forward, so a ranking of every (layer, head) margin of the request is
    not available when layer l routes. The budget is cumulative instead: over the slots p = l * num_groups + group
    (layer-major), c(p) = floor(target * (p + 1) * group_heads + 1/2) SA heads so far, and slot p gets
    c(p) - c(p - 1). The model-wide total is c(L * num_groups - 1) = round-half-up(target * L * H) exactly, each
    layer's total over the groups is the same as without tensor parallelism, and each rank needs no message. The
    trade-off: heads are ranked within a layer (and rank), not across layers, so a layer whose heads all prefer
    FA still gives its share (a global ranking would need every layer's router before the first layer's
    attention, i.e. a second forward)."""
    c = [int(target * (p + 1) * group_heads + 0.5) for p in range(num_layers * num_groups)]
    return [c[p] - (c[p - 1] if p else 0) for p in (layer * num_groups + group for layer in range(num_layers))]


def decide_budget(logits: torch.Tensor, num_sa: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """True where the head runs FA under a fixed budget: the ``num_sa[r]`` heads of row r with the lowest margin
    ``z_FA - z_SA`` (the router prefers SA most) run SA, ties to the lower head index. logits [R, H, 2],
    num_sa [R] (long, on logits' device). A head with NaN / inf logits ranks after the finite ones, and a head of
    ``floor`` ([H] bool: the fail-safe floor, ``ElasticConfig.fa_floor``) after every other head: each goes SA
    only when the budget needs it, so the count stays exact."""
    z = logits.float()
    m = z[..., FA_INDEX] - z[..., 1 - FA_INDEX]
    m = torch.where(torch.isfinite(z).all(-1), m, torch.full_like(m, float("inf")))
    order = torch.sort(m, dim=-1, stable=True).indices
    if floor is not None:  # a second stable sort: floor heads last, each group in margin order
        key = floor.to(m.device).expand_as(m).gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(key, dim=-1, stable=True).indices)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(m.shape[-1], device=m.device).expand_as(order).contiguous())
    return rank >= num_sa.view(-1, 1)


def boundary_positions(length: int, n: int, device=None) -> torch.Tensor:
    """Positions pooled for a prompt of ``length`` tokens: the first ``n`` and the last
    ``n``, without counting a token twice (a prompt shorter than 2n pools all tokens).

    >>> boundary_positions(5, 2).tolist()
    [0, 1, 3, 4]
    >>> boundary_positions(3, 2).tolist()
    [0, 1, 2]
    """
    if length <= 0:
        raise ValueError(f"cannot pool an empty prompt (length {length})")
    if length <= 2 * n:
        return torch.arange(length, device=device)
    return torch.cat([torch.arange(n, device=device), torch.arange(length - n, length, device=device)])


def pool_keys(keys: torch.Tensor, pooling: str = "boundary", n: int = 100) -> torch.Tensor:
    """Pool the keys of ONE prompt. keys [T, H_kv, d] -> [H_kv, d] (float32).

    pooling="boundary": mean over the first/last ``n`` tokens (the paper's inference);
    pooling="whole": mean over all T tokens (the authors' training code).
    """
    if keys.dim() != 3:
        raise ValueError(f"keys must be [T, H_kv, d], got shape {tuple(keys.shape)}")
    T = keys.shape[0]
    if pooling == "whole":
        if T == 0:
            raise ValueError("cannot pool an empty prompt (length 0)")
        return keys.float().mean(0)
    if pooling != "boundary":
        raise ValueError(f"unknown pooling {pooling!r} (expected 'boundary' or 'whole')")
    idx = boundary_positions(T, n, device=keys.device)
    return keys.index_select(0, idx).float().mean(0)


def pool_keys_varlen(
    keys: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str = "boundary", n: int = 100
) -> torch.Tensor:
    """Pool a packed batch. keys [total, H_kv, d], cu_seqlens [B+1] -> [B, H_kv, d]."""
    bounds = cu_seqlens.tolist()
    return torch.stack([pool_keys(keys[s:e], pooling, n) for s, e in itertools.pairwise(bounds)])


def num_parameters_per_layer(head_dim: int, hidden_mult: int = 4) -> int:
    return sum(p.numel() for p in LayerRouter(head_dim, hidden_mult).parameters())
