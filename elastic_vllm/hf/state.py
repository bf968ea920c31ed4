"""Per-model state of the transformers integration: config, router, and what the last prefill decided.

One ``ElasticState`` hangs off the model (``model.elastic_state``) and off every attention module.
It is plain Python (not an ``nn.Module``): the router it holds is NOT a submodule of the backbone, so
sharding, freezing or saving the backbone never touches it.

Routing lifecycle of a request batch::

    prefill forward (no past keys)   -> every layer routes each row from its own prompt keys
                                        -> routing[:, layer] = bool [B, H_kv], logits[:, layer] = [B, H_kv, 2]
    decode forwards (past keys > 0)  -> every layer reuses routing[:, layer] (the router does not run)

``last_routing`` is True where a KV head runs the retrieval ("FA") mode, index 1 of the router logits,
the same convention as ``elastic_vllm.router.model.decide``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from elastic_vllm.config import ElasticConfig
from elastic_vllm.router.model import ElasticRouter
from elastic_vllm.router.policy import floor_of


@dataclass
class TrainContext:
    """What one training forward needs besides the tokens (set by the trainer, cleared after).

    prompt_lens [B]: the router pools over the prompt only (the answer is unknown at inference).
    gumbel [B, L, H_kv, 2]: Gumbel noise drawn before the forward, so that gradient-checkpoint
    recomputation sees the same noise. tau: Gumbel-softmax temperature.
    r[layer] [B, H_kv, 2]: straight-through routing values (index 1 = FA), for the sparsity loss.
    """

    prompt_lens: torch.Tensor
    gumbel: torch.Tensor | None
    tau: float
    r: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)

    def r_stack(self) -> torch.Tensor:
        """[B, L, H_kv, 2] straight-through routing of every layer (in layer order)."""
        return torch.stack([self.r[i] for i in sorted(self.r)], dim=1)


@dataclass
class ElasticState:
    cfg: ElasticConfig
    num_layers: int
    num_kv_heads: int
    head_dim: int
    router: ElasticRouter | None = None
    impl: str = "torch"  # "torch" (fast path) | "reference" (elastic_vllm.reference oracle)
    # optional routing override for experiments and tests: bool [L, H_kv] or [B, L, H_kv] (True = FA)
    fixed_routing: torch.Tensor | None = None
    train: TrainContext | None = None
    # what the last prefill decided, per request row
    routing: torch.Tensor | None = None  # bool [B, L, H_kv]
    logits: torch.Tensor | None = None  # float32 [B, L, H_kv, 2] (None when no router ran)
    xa_masks: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)  # (b, layer, h) -> blocks
    # the current forward, set by a pre-hook on the base model (attention modules read it)
    padding_mask: torch.Tensor | None = None  # bool [B, past + new] (True = real token), None = no padding
    in_prefill: bool = False
    # per layer: (HeadMode [B, Hkv] on the device, the set of modes present) for decode steps, so
    # that a decode step needs no host sync (filled at the first decode step of a request batch)
    decode_cache: dict[int, tuple[torch.Tensor, frozenset]] = field(default_factory=dict)
    num_prefills: int = 0  # forwards that routed (one per request batch)
    num_router_calls: int = 0  # router forward calls (one per layer per prefill)
    hooks: list[Any] = field(default_factory=list)
    floor: torch.Tensor | None = None  # bool [L, H_kv] fa_floor mask (policy.floor_of), None: off

    def __post_init__(self) -> None:
        self.floor = floor_of(self.router, self.cfg)

    # --- what callers read -------------------------------------------------------------------
    @property
    def last_routing(self) -> torch.Tensor | None:
        """bool [B, L, H_kv], True = the head ran the retrieval (FA-side) mode at the last prefill."""
        return self.routing

    @property
    def last_logits(self) -> torch.Tensor | None:
        """float32 [B, L, H_kv, 2] router logits of the last prefill (index 1 = FA), or None."""
        return self.logits

    def omega_msr(self) -> torch.Tensor:
        """Per-request Omega_MSR [B] of the last prefill (share of KV heads routed to SA)."""
        if self.routing is None:
            raise RuntimeError("no prefill has run through the elastic model yet")
        return (~self.routing).float().mean(dim=(1, 2))

    def set_config(self, **updates: Any) -> None:
        """Change knobs at run time, e.g. ``state.set_config(force="all-FA", decode_mode="sparse")``."""
        cfg = ElasticConfig.parse({**self.cfg.model_dump(), **updates})
        self.floor = floor_of(self.router, cfg)  # a floor > 0 needs the router's ranking: checked now
        self.cfg = cfg
        self.decode_cache = {}

    # --- written by the forward pre-hook and the attention function -------------------------------
    def begin_prefill(self, batch: int, device: torch.device) -> None:
        L, H = self.num_layers, self.num_kv_heads
        self.routing = torch.zeros(batch, L, H, dtype=torch.bool, device=device)
        self.logits = None
        self.xa_masks = {}
        self.decode_cache = {}
        self.num_prefills += 1

    def record(self, layer: int, is_fa: torch.Tensor, logits: torch.Tensor | None) -> None:
        assert self.routing is not None
        self.routing[:, layer] = is_fa.to(self.routing.device)
        if logits is not None:
            if self.logits is None:
                B, L, H = self.routing.shape
                self.logits = torch.zeros(B, L, H, 2, dtype=torch.float32, device=logits.device)
            self.logits[:, layer] = logits.detach().float()
