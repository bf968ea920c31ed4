"""Per-request routing override, sent by clients through vLLM's extra-args channel.

OpenAI API: ``{"vllm_xargs": {"elastic_force": "all-SA"}}`` in the request body; offline:
``SamplingParams(extra_args={"elastic_force": "all-FA"})``. Values: ``auto`` (the server's default,
i.e. its ``force`` setting), ``all-FA``, ``all-SA``. Anything else is rejected at admission
(HTTP 400) with a message naming the field.

Test-time elasticity: ``elastic_bias`` (a finite number in [-1024, 1024], router logits, added to the SA side of
every head's margin: FA iff ``z_FA - z_SA > bias - sa_margin``, so > 0 is sparser) and ``elastic_target_omega``
(a number in [0, 1]: exactly round-half-up(target x layers x KV heads) of the request's heads run SA, the ones the
router prefers SA most in each layer, :func:`router.model.budget_sa_counts`). One of the two per request, not with
``elastic_force`` other than auto; they replace the server's ``bias`` / ``target_omega`` for that request.
``elastic_load_bias`` is written by the engine's load policy (``load_policy.py``) and refused from clients.
Retired keys (``config.RETIRED_CLIENT_OVERRIDES``, e.g. ``elastic_sa_share``) are refused naming their replacement,
and any other key that reads ``elastic...`` once case, surrounding whitespace, ``_`` and ``-`` are set aside
(``ELASTIC_FORCE``, ``" elastic_force"``, ``elasticforce``, ``elastic_forc``) naming the known ones: a client that
sends one would otherwise run the server's default routing without noticing.

The server's ``client_overrides`` (``ElasticConfig``) says which of ``all-FA``, ``all-SA``,
``elastic_bias`` and ``elastic_target_omega`` clients may send; a request using another
one is refused at admission (HTTP 400).

Prefix-cache isolation: the K/V of a prompt depend on how every earlier layer attended, i.e. on the
routing mode the request ran with. :func:`routing_cache_salt` is added to every request's
``cache_salt`` at admission (``compat.install_request_validator``), so vLLM hashes the blocks of
requests of different modes apart: a request reuses only blocks computed under its own mode
(auto, all-FA, all-SA, one bias or one target; the load policy adds its bias level in the
engine core) and the same server configuration.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from elastic_vllm.config import BIAS_MAX, FORCES, RETIRED_CLIENT_OVERRIDES, ConfigError, ElasticConfig, short_repr

OVERRIDE_KEY = "elastic_force"
BIAS_KEY = "elastic_bias"
TARGET_KEY = "elastic_target_omega"
LOAD_BIAS_KEY = "elastic_load_bias"  # written by the engine core's load policy, never by a client
# Any other key that starts with this once case, surrounding whitespace, "_" and "-" are set aside is refused: a
# misspelt knob ("elastic_forc", "ELASTIC_FORCE", " elastic_force", "elasticforce") would otherwise be ignored and the
# request would run the server's default routing without the client noticing.
KEY_PREFIX = "elastic"
CLIENT_KEYS = (OVERRIDE_KEY, BIAS_KEY, TARGET_KEY)


def normalized_key(key: str) -> str:
    """``key`` as a misspelling may disguise it: casefolded, stripped, without "_" and "-"."""
    return key.strip().casefold().replace("_", "").replace("-", "")


_NORMALIZED_CLIENT_KEYS = {normalized_key(k): k for k in CLIENT_KEYS}


def _unknown_key_error(key: str) -> ValueError:
    """The 400 for a key that looks like one of ours but is none: named as sent (quoted when it has odd characters)
    and the known keys, with the one it was probably meant to be."""
    name = key if len(key) <= 80 and key.isprintable() and key == key.strip() else short_repr(key)
    meant = _NORMALIZED_CLIENT_KEYS.get(normalized_key(key))
    hint = f"did you mean {meant}? " if meant else ""
    return ValueError(f"vllm_xargs.{name}: not an elastic-vllm key ({hint}known: {', '.join(CLIENT_KEYS)})")


def request_override(extra_args: dict[str, Any] | None) -> str:
    """The override of one request: "auto" when absent. Raises ValueError for an unknown value."""
    if not extra_args or OVERRIDE_KEY not in extra_args:
        return "auto"
    value = extra_args[OVERRIDE_KEY]
    if value not in FORCES:
        raise ValueError(
            f"vllm_xargs.{OVERRIDE_KEY}: must be one of {', '.join(repr(f) for f in FORCES)} (got {short_repr(value)})"
        )
    return value


@dataclass(frozen=True)
class Knobs:
    """A request's own elasticity knobs (at most one is set)."""

    bias: float | None = None
    target: float | None = None

    @property
    def key(self) -> str | None:
        return BIAS_KEY if self.bias is not None else TARGET_KEY if self.target is not None else None


def _number(extra: dict[str, Any], key: str, lo: float, hi: float) -> float:
    value = extra[key]
    # bool is an int in Python, and True would silently be 1.0 (over HTTP vLLM already turns true into 1)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"vllm_xargs.{key}: must be a number in [{lo:g}, {hi:g}] (got {short_repr(value)})")
    if not math.isfinite(value):
        raise ValueError(f"vllm_xargs.{key}: must be a finite number in [{lo:g}, {hi:g}] (got {short_repr(value)})")
    if not lo <= value <= hi:
        raise ValueError(f"vllm_xargs.{key}: must be in [{lo:g}, {hi:g}] (got {short_repr(value)})")
    return float(value)


def request_knobs(extra_args: dict[str, Any] | None) -> Knobs:
    """The request's ``elastic_bias`` / ``elastic_target_omega`` (see the module docstring). Raises ValueError
    naming the field for a bad value, both together, either with ``elastic_force`` other than auto, for
    ``elastic_load_bias`` (the engine's own key) and for a retired key (naming its replacement)."""
    if not extra_args:
        return Knobs()
    if LOAD_BIAS_KEY in extra_args:
        raise ValueError(f"vllm_xargs.{LOAD_BIAS_KEY}: set by the server's load policy, not by clients")
    for key, use in RETIRED_CLIENT_OVERRIDES.items():
        if key in extra_args:
            raise ValueError(f"vllm_xargs.{key}: no longer supported; {use}")
    for key in extra_args:
        if isinstance(key, str) and key not in CLIENT_KEYS and normalized_key(key).startswith(KEY_PREFIX):
            raise _unknown_key_error(key)
    bias = _number(extra_args, BIAS_KEY, -BIAS_MAX, BIAS_MAX) if BIAS_KEY in extra_args else None
    target = _number(extra_args, TARGET_KEY, 0.0, 1.0) if TARGET_KEY in extra_args else None
    knobs = Knobs(bias, target)
    if knobs.key is None:
        return knobs
    if bias is not None and target is not None:
        raise ValueError(f"vllm_xargs.{BIAS_KEY}: cannot be combined with {TARGET_KEY} (send one of the two)")
    force = request_override(extra_args)
    if force != "auto":
        raise ValueError(f"vllm_xargs.{knobs.key}: cannot be combined with {OVERRIDE_KEY}={force!r}")
    return knobs


def check_allowed(override: str, cfg: ElasticConfig, knobs: Knobs = Knobs()) -> None:
    """Raises ValueError naming the field when the server's ``client_overrides`` does not allow it, or when a knob
    needs the router on a server whose ``force`` is not auto."""
    allowed = cfg.client_overrides
    if override != "auto" and override not in allowed:
        raise ValueError(
            f"vllm_xargs.{OVERRIDE_KEY}: {override!r} is not allowed by this server "
            f"(elastic.client_overrides = {list(allowed)})"
        )
    key = knobs.key
    if key is not None and key not in allowed:
        raise ValueError(f"vllm_xargs.{key}: not allowed by this server (elastic.client_overrides = {list(allowed)})")
    if key is not None and cfg.force != "auto":
        raise ValueError(f"vllm_xargs.{key}: needs the router, but this server runs elastic.force = {cfg.force!r}")


def validate_sampling_params(params: Any, cfg: ElasticConfig | None = None) -> None:
    """Admission check (API server / LLM process): raises ValueError naming the field. With ``cfg``
    (the server's configuration) the request must also use only the overrides it allows."""
    extra = getattr(params, "extra_args", None)
    override = request_override(extra)
    knobs = request_knobs(extra)
    if cfg is not None:
        check_allowed(override, cfg, knobs)


_SERVER_CONFIGS: dict[str, tuple[ElasticConfig, str]] = {}


def server_config(vllm_config: Any) -> tuple[ElasticConfig, str] | None:
    """(the ElasticConfig of ``--additional-config``, a digest of what the K/V depend on) of an engine
    config; None when it is invalid (the startup check refuses it, naming the field)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("elastic") if isinstance(extra, dict) else None
    try:
        key = json.dumps(raw, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
    hit = _SERVER_CONFIGS.get(key)
    if hit is None:
        try:
            cfg = ElasticConfig.parse(raw)
        except ConfigError:
            return None
        # every field but client_overrides changes what a request computes
        kv = json.dumps(cfg.model_dump(exclude={"client_overrides"}), sort_keys=True)
        hit = _SERVER_CONFIGS[key] = (cfg, hashlib.sha256(kv.encode()).hexdigest()[:16])
        if len(_SERVER_CONFIGS) > 16:  # one config per engine: a handful at most in one process
            _SERVER_CONFIGS.pop(next(iter(_SERVER_CONFIGS)))
    return hit


def routing_mode(override: str, server_force: str, knobs: Knobs = Knobs(), load_bias: float = 0.0) -> str:
    """The mode a request runs with, as recorded in ``elastic:requests_total{override}`` and mixed into
    its cache salt: auto, all-FA, all-SA (its own override or the server's force), bias, target-omega (its
    own knob), or load-bias (the load policy raised its bias)."""
    if knobs.bias is not None:
        return "bias"
    if knobs.target is not None:
        return "target-omega"
    force = effective_force(override, server_force)
    return "load-bias" if force == "auto" and load_bias > 0 else force


def routing_cache_salt(extra_args: dict[str, Any] | None, cfg: ElasticConfig, cfg_digest: str) -> str:
    """The part of a request's cache salt that its routing mode decides (see the module docstring). An
    invalid or disallowed override was refused before this runs; here it counts as the server's default,
    as in the engine."""
    try:
        override, knobs = request_override(extra_args), request_knobs(extra_args)
        check_allowed(override, cfg, knobs)
    except ValueError:
        override, knobs = "auto", Knobs()
    mode = routing_mode(override, cfg.force, knobs)
    value = knobs.bias if knobs.bias is not None else knobs.target
    if value is not None:
        mode = f"{mode}={value!r}"
    return f"elastic:{mode}:{cfg_digest}"


def load_bias_salt(load_bias: float) -> str:
    """What the engine core appends to the cache salt of a request the load policy biased (one of its few levels)."""
    return f"elastic:load-bias={load_bias!r}"


def is_load_policy_eligible(extra_args: dict[str, Any] | None, cfg: ElasticConfig) -> bool:
    """A request the load policy may bias: valid, with no elastic knob of its own (bias, target, force)
    on a server routing with its router (force auto). Requests that chose keep their choice."""
    if cfg.force != "auto":
        return False
    try:
        override, knobs = request_override(extra_args), request_knobs(extra_args)
    except ValueError:
        return False
    return override == "auto" and knobs.key is None


def engine_load_bias(extra_args: dict[str, Any] | None, max_bias: float) -> float:
    """The load bias the engine core wrote into a request (0 when none); a value outside [0, max_bias] means a
    broken invariant: ValueError."""
    if not extra_args or LOAD_BIAS_KEY not in extra_args:
        return 0.0
    value = extra_args[LOAD_BIAS_KEY]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= max_bias:
        raise ValueError(f"{LOAD_BIAS_KEY}: must be a number in [0, {max_bias:g}] (got {short_repr(value)})")
    return float(value)


def salted(client_salt: str | None, routing_salt: str) -> str:
    """The request's cache_salt: the client's own (isolation between tenants), then the routing part."""
    return f"{client_salt}|{routing_salt}" if client_salt else routing_salt


def effective_force(override: str, server_force: str) -> str:
    """What a request runs with: its own override, or the server's ``force`` when it says auto."""
    return server_force if override == "auto" else override
