"""ElasticConfig: every knob of Elastic Attention, validated once.

The same object configures the transformers path, the vLLM backend (through
``--additional-config '{"elastic": {...}}'``) and the benchmarks. Validation
errors name the offending field, e.g. ``elastic.window: must be >= 1``.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

Mode = Literal["FA-SSA", "FA-XA", "XA-SSA"]
Pooling = Literal["boundary", "whole"]
DecodeMode = Literal["dense", "sparse"]
Force = Literal["auto", "all-FA", "all-SA"]
ChunkRouting = Literal["prefix", "dense"]

MODES: tuple[str, ...] = ("FA-SSA", "FA-XA", "XA-SSA")
FORCES: tuple[str, ...] = ("auto", "all-FA", "all-SA")
CHUNK_ROUTINGS: tuple[str, ...] = ("prefix", "dense")
ClientOverride = Literal["all-FA", "all-SA", "elastic_bias", "elastic_target_omega"]
CLIENT_OVERRIDES: tuple[str, ...] = ("all-FA", "all-SA", "elastic_bias", "elastic_target_omega")
# Per-request keys that no longer exist -> what to use instead. A deployment listing one in client_overrides and
# a request sending one are refused with this hint: silently ignoring it would run another routing than asked for.
RETIRED_CLIENT_OVERRIDES: dict[str, str] = {
    "elastic_sa_share": "use elastic_target_omega (a number in [0, 1]: the same number of SA heads per layer, "
    "the heads chosen by the router)",
}

# Upper bound of the token counts (sink, window, pool_tokens): the Triton kernels take them as int32
# and add two of them (e.g. a query position and a window), so 2**30 keeps every sum below 2**31; a
# value at or above the served max_model_len already means "the whole prompt".
MAX_TOKENS = 2**30
# The reference XA selection pads each head's score matrix to (xattn_block / xattn_stride)**2
# entries: 4096 keeps it at most 64 MiB per query head (the paper uses 128).
MAX_XATTN_BLOCK = 4096

# |sa_margin| bound: the shipped SmolLM2 router's logit differences z_FA - z_SA reach -737 / +141 on prompts of
# the generalization split (code/system, chat/after; float32 on the CPU), so 1024 already routes every head FA
SA_MARGIN_MAX = 1024.0
# The fail-safe floor's default (fa_floor unset): this share of (layer, KV head) pairs stays FA where the router
# holds a retrieval ranking (18 of SmolLM2's 90, which hold 95% of its needle attention mass). Measured through
# `elastic-vllm serve` on held-out families (benchmarks/results/generalization-served-smollm2-cpu): the shipped
# router alone found a number in documentation 42% / in Python source 72% of the time (dense 100% / 98%) at
# Omega_MSR 0.92-0.97 and lost up to 0.38 nats on continuations; with this floor 100% / 98% at 0.73-0.79, every
# counted family at >= 96% of dense, continuations at most 0.031 nats above dense at mean Omega_MSR 0.69.
FA_FLOOR_DEFAULT: float = 0.2
# |bias| bound (deployment `bias`, per-request `elastic_bias`, load policy `max_bias`): the same logit scale as
# sa_margin, so 1024 already routes every head of the shipped router either way
BIAS_MAX = SA_MARGIN_MAX


class HeadMode(IntEnum):
    """What one KV head computes. Stored as int8 in kernel metadata."""

    FA = 0  # full causal attention
    SSA = 1  # streaming: sink + sliding window
    XA = 2  # XAttention block-sparse (selected block list)


class ConfigError(ValueError):
    """Raised for invalid elastic configuration; the message names the field."""


class LoadPolicy(BaseModel):
    """Load-adaptive routing bias (opt-in): the engine raises the bias of requests that set no knob of their own
    as its prefill backlog grows, and lowers it as the backlog falls (``vllm_plugin/load_policy.py``).

    backlog = prompt tokens queued for prefill (waiting and running requests) / ``max_num_batched_tokens``, i.e.
    scheduler steps of prefill work ahead; smoothed with an EMA (weight ``ema`` per step); bias = ``max_bias`` x
    clamp((backlog - ``low``) / (``high`` - ``low``), 0, 1), rounded down to one of ``levels`` steps of
    ``max_bias / levels`` (each level is a cache salt of its own: a few levels keep prefix-cache sharing)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, strict=True)
    # Default 32: the bias is in the router's own logits, and the shipped SmolLM2 router's margins |z_FA - z_SA|
    # reach hundreds of logits (737 on the held-out families, see sa_margin), so a ceiling far below that scale moves
    # only the heads the router is unsure about. Measured for the shipped router: at 32 it costs no retrieval answer
    # on the held-out families (Omega_MSR 0.58 -> 0.67 there) but moves the demo load ramp's random prompts only
    # 0.665 -> 0.692, too little to cut p99 TTFT 1.5x at 2x load; at 128 one answer in 240, Omega_MSR 0.79.
    # Routers' logit scales differ: set it per router.
    max_bias: float = Field(
        32.0, gt=0.0, le=BIAS_MAX, allow_inf_nan=False, description="ceiling of the load bias, in router logits"
    )
    # low 1: a backlog under one step's token budget is drained by the next step, so no request queues behind it;
    # low and high are bounded by 1e6 steps, far past any queue an engine holds, so a typo cannot hide as "never"
    low: float = Field(
        1.0, ge=0.0, le=1e6, allow_inf_nan=False, description="backlog (scheduler steps) below which the bias is 0"
    )
    # high 8: a request arriving then waits at least 8 prefill steps for its first token (not tuned on a load ramp:
    # the GPU ramp of the issue is what measures where saturation starts)
    high: float = Field(
        8.0, gt=0.0, le=1e6, allow_inf_nan=False, description="backlog (scheduler steps) at which the bias is max_bias"
    )
    # ema 0.2: ~5 steps of memory, so one burst step moves the smoothed backlog by a fifth of its size
    ema: float = Field(0.2, gt=0.0, le=1.0, allow_inf_nan=False, description="EMA weight of the newest step")
    # levels 4: with 0, five salts, so prefix sharing between requests without a knob splits at most five ways
    levels: int = Field(4, strict=True, ge=1, le=64, description="bias levels above 0 (each its own cache salt)")

    @field_validator("max_bias", "low", "high", "ema", mode="before")
    @classmethod
    def _is_a_number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"must be a number, got {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _check(self) -> LoadPolicy:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be greater than low ({self.low})")
        return self


class ElasticConfig(BaseModel):
    """Configuration of Elastic Attention.

    Modes are written "{retrieval-head mode}-{sparse-head mode}": in ``FA-SSA``
    (default) heads the router sends to FA run full attention and the others
    streaming attention (``sink`` first tokens + the last ``window`` tokens);
    ``FA-XA`` makes the sparse heads XAttention block-sparse; ``XA-SSA`` runs the
    retrieval heads with XAttention too (the fully sparse regime).

    Streaming mask, token exact (key j visible to query i)::

        j <= i  and  (j < sink  or  i - j < window)

        keys ->  S S . . . . W W W
        query i: x x . . . . x x x     (S = sink, W = window ending at i)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "FA-SSA"
    sink: int = Field(128, strict=True, ge=0, le=MAX_TOKENS, description="attention-sink tokens kept by SSA heads")
    window: int = Field(2048, strict=True, ge=1, le=MAX_TOKENS, description="local window of SSA heads, in tokens")
    xattn_stride: int = Field(16, strict=True, ge=1, le=MAX_XATTN_BLOCK, description="XAttention antidiagonal stride")
    xattn_threshold: float = Field(
        0.9,
        strict=True,
        allow_inf_nan=False,
        gt=0.0,
        le=1.0,
        description="XAttention cumulative-mass threshold tau (paper 0.9)",
    )
    xattn_block: int = Field(128, strict=True, ge=16, le=MAX_XATTN_BLOCK, description="XAttention block size in tokens")
    pooling: Pooling = "boundary"
    pool_tokens: int = Field(
        100, strict=True, ge=1, le=MAX_TOKENS, description="boundary pooling: first/last N prompt tokens"
    )
    decode_mode: DecodeMode = "dense"
    router_path: str | None = Field(None, strict=True, min_length=1)
    force: Force = "auto"
    # Chunked prefill (vLLM serving): every chunk before the one that completes the prompt runs with
    # the routing of the prompt prefix processed so far ("prefix"), or with every head FA ("dense").
    # The routing of the chunk that completes the prompt is final either way; without chunking
    # both are exactly the paper's once-per-request routing.
    chunk_routing: ChunkRouting = "prefix"
    # Which per-request overrides clients may send (vllm_xargs): "all-FA" / "all-SA" as elastic_force,
    # "elastic_bias", "elastic_target_omega". Anything else is refused with HTTP 400; elastic_force "auto"
    # (the server's own routing) is always allowed. [] turns client overrides off.
    client_overrides: tuple[ClientOverride, ...] = CLIENT_OVERRIDES

    @field_validator("client_overrides", mode="before")
    @classmethod
    def _no_retired_override(cls, v: Any) -> Any:
        # a retired key names its replacement (the Literal's own error would only list the valid values)
        for item in v if isinstance(v, (list, tuple)) else ():
            if isinstance(item, str) and item in RETIRED_CLIENT_OVERRIDES:
                raise ValueError(f"{item!r} is no longer supported: {RETIRED_CLIENT_OVERRIDES[item]}")
        return v

    @field_validator("router_path")
    @classmethod
    def _router_path(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must name a router folder (an empty path would mean the working directory)")
        return v

    # Fail-safe routing margin, in router logits: a KV head goes SA only when the router prefers SA by at
    # least this much, i.e. FA iff z_FA - z_SA > -sa_margin (float32, every routing path). 0 = the
    # router's argmax (ties -> SA); larger keeps more heads FA on prompts the router is unsure about.
    # Default 0, measured: on the held-out families the shipped router's margin 256 moved sensitive AND robust
    # prompts alike (Omega_MSR 0.78 -> 0.09 and 0.79 -> 0.13, benchmarks/results/generalization-smollm2-cpu), so
    # no margin meets both the sensitive (<= 0.4) and robust (>= 0.8) targets with it; 0 keeps the committed
    # RULER results exact. The logit scale is the router's own (|z_FA - z_SA| up to 737 here).
    sa_margin: float = Field(
        0.0,
        ge=-SA_MARGIN_MAX,
        le=SA_MARGIN_MAX,
        allow_inf_nan=False,
        description="fail-safe routing margin, in router logits: a KV head goes SA only when the router prefers "
        "SA by at least this much (FA iff `z_FA - z_SA > -sa_margin`, float32, in every routing path); `0` = the "
        "router's argmax, larger keeps more heads FA, negative routes more to SA",
    )

    # Test-time elasticity (docs/serving.md, "Elasticity control"). Sign convention: a KV head runs FA iff
    # z_FA - z_SA > bias - sa_margin, so bias > 0 routes more heads to SA (sparser), < 0 fewer (denser); a
    # request's own elastic_bias replaces this one.
    bias: float = Field(
        0.0,
        ge=-BIAS_MAX,
        le=BIAS_MAX,
        allow_inf_nan=False,
        description="routing bias added to the SA side of every head's router margin, in router logits (FA iff "
        "`z_FA - z_SA > bias - sa_margin`): `> 0` sparser, `< 0` denser, `0` = today's routing; a request's "
        "`elastic_bias` replaces it",
    )
    target_omega: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="fixed SA budget per request: exactly round(target_omega x layers x KV heads) (half up) of a "
        "request's (layer, KV head) pairs run SA, the lowest router margins of each layer (a cumulative per-layer "
        "budget); `null` = the router decides alone; a request's `elastic_bias` / `elastic_target_omega` replaces it",
    )
    load_policy: LoadPolicy = Field(default_factory=lambda: LoadPolicy())
    # The fail-safe floor: the KV heads that carry retrieval (the router checkpoint's ranking, router.json
    # "retrieval") run FA in auto routing whatever the router and the bias decide. On a retrieval prompt unlike
    # the training mixture the shipped SmolLM2 router found 2 / 10 answers at Omega_MSR 0.96; its 9 (of 90) heads
    # of the highest static retrieval scores forced FA found 9 / 10 at 0.86 (dense: 10 / 10). Default:
    # FA_FLOOR_DEFAULT, with its measurement.
    fa_floor: int | float | None = Field(
        None,
        description="fail-safe floor: the KV heads ranked highest for retrieval by the router checkpoint (attention "
        "mass on needle tokens under dense attention) always run FA in `auto` routing, whatever the router and the "
        "bias decide (they count in Omega_MSR as FA); an int >= 0 is a count of heads, a float in (0, 1) a share "
        "of all (layer, KV head) pairs (rounded half up); `0` = off; unset (null): the default share "
        f"{FA_FLOOR_DEFAULT} where the router holds a ranking, off where it holds none. A request's `elastic_force` overrides it; with "
        "a fixed SA budget (`target_omega`, `elastic_target_omega`) the count stays exact and the floor's heads "
        "are the last to go SA. Needs a router with a ranking (`elastic-vllm router-rank ROUTER_DIR --model "
        "MODEL_DIR` adds one)",
    )

    @field_validator("fa_floor", mode="before")
    @classmethod
    def _floor(cls, v: Any) -> Any:
        # an int is a count, a float a share: 9.0 would be ambiguous, and True would silently become 1
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"must be a number (a count of heads or a share in (0, 1)), got {type(v).__name__}")
        if isinstance(v, int) and v < 0:
            raise ValueError("a count of heads must be >= 0")
        if isinstance(v, float) and not 0.0 < v < 1.0:
            raise ValueError("a share of heads must be in (0, 1) (an int for a count, 0 for off)")
        return v

    @field_validator("sa_margin", "bias", "target_omega", mode="before")
    @classmethod
    def _knob_is_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        # bool is an int in Python: True would silently become 1.0; only target_omega may be null (off)
        if v is None and info.field_name == "target_omega":
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"must be a number, got {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _check(self) -> ElasticConfig:
        if self.xattn_block % self.xattn_stride != 0:
            raise ValueError(
                f"xattn_block ({self.xattn_block}) must be a multiple of xattn_stride ({self.xattn_stride})"
            )
        if self.bias != 0.0 and self.target_omega is not None:
            raise ValueError("bias and target_omega cannot be combined (a fixed budget ignores the bias)")
        knobs = [k for k, on in (("bias", self.bias != 0.0), ("target_omega", self.target_omega is not None),
                                 ("load_policy", self.load_policy.enabled)) if on]  # fmt: skip
        if knobs and self.force != "auto":
            verb = "needs" if len(knobs) == 1 else "need"
            raise ValueError(f"{', '.join(knobs)} {verb} the router, but force is {self.force!r} (use force 'auto')")
        if self.load_policy.enabled and self.target_omega is not None:
            raise ValueError("load_policy cannot be combined with target_omega (a fixed budget ignores the bias)")
        return self

    # --- derived -----------------------------------------------------------------
    @property
    def fa_mode(self) -> HeadMode:
        """Head mode of heads routed to FA (router index 1)."""
        return HeadMode.XA if self.mode == "XA-SSA" else HeadMode.FA

    @property
    def sa_mode(self) -> HeadMode:
        """Head mode of heads routed to SA (router index 0)."""
        return HeadMode.XA if self.mode == "FA-XA" else HeadMode.SSA

    @property
    def uses_xattn(self) -> bool:
        return self.mode != "FA-SSA"

    @classmethod
    def parse(cls, raw: Any, prefix: str = "elastic") -> ElasticConfig:
        """Build from a dict / JSON string / ElasticConfig; errors name the field.

        ``ElasticConfig.parse({"window": 0})`` raises ``ConfigError("invalid elastic
        config: elastic.window: Input should be greater than or equal to 1 (got 0)")``.
        """
        if isinstance(raw, ElasticConfig):
            return raw
        if raw is None:
            raw = {}
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"invalid elastic config: {prefix} is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"invalid elastic config: {prefix} must be a JSON object, got {type(raw).__name__}")
        try:
            return cls(**raw)
        except ValidationError as e:
            raise ConfigError(f"invalid elastic config: {format_validation_error(e, prefix)}") from None
        except TypeError as e:  # e.g. non-string keys
            raise ConfigError(f"invalid elastic config: {prefix}: {e}") from None


def format_validation_error(e: ValidationError, prefix: str) -> str:
    """One line per problem, each naming the field: ``elastic.window: ...``."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "__root__")
        where = f"{prefix}.{loc}" if loc else prefix
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field (valid fields: {', '.join(ElasticConfig.model_fields)})"
        elif "input" in err and err.get("type") != "missing":
            msg = f"{msg} (got {short_repr(err['input'])})"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages (and HTTP 400 bodies) echo what was
    sent, but never a 5 MB value back."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[: limit - 20]}... ({len(r)} characters)"
