"""Per-request routing override, sent by clients through vLLM's extra-args channel.

OpenAI API: ``{"vllm_xargs": {"elastic_force": "all-SA"}}`` in the request body; offline:
``SamplingParams(extra_args={"elastic_force": "all-FA"})``. Values: ``auto`` (the server's default,
i.e. its ``force`` setting), ``all-FA``, ``all-SA``. Anything else is rejected at admission
(HTTP 400) with a message naming the field.

Benchmarks only: ``elastic_sa_share`` (a number in [0, 1]) replaces the router's decisions of the request
by a fixed head assignment with that share of SA heads (:func:`routing.fixed_share_fa`). The router
still runs when the request would run it (server ``force`` auto), so its cost stays in the timing.
It cannot be combined with an ``elastic_force`` other than auto.

The server's ``client_overrides`` (``ElasticConfig``) says which of ``all-FA``, ``all-SA`` and
``elastic_sa_share`` clients may send; a request using another one is refused at admission (HTTP 400).

Prefix-cache isolation: the K/V of a prompt depend on how every earlier layer attended, i.e. on the
routing mode the request ran with. :func:`routing_cache_salt` is added to every request's
``cache_salt`` at admission (``compat.install_request_validator``), so vLLM hashes the blocks of
requests of different modes apart: a request reuses only blocks computed under its own mode
(auto, all-FA, all-SA, or one fixed SA share) and the same server configuration.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from elastic_vllm.config import FORCES, ConfigError, ElasticConfig, short_repr

OVERRIDE_KEY = "elastic_force"
SHARE_KEY = "elastic_sa_share"


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


def request_sa_share(extra_args: dict[str, Any] | None) -> float | None:
    """The fixed SA share of one request (benchmarks), None when absent. Raises ValueError when it is
    not a number in [0, 1] or comes with an ``elastic_force`` other than auto."""
    if not extra_args or SHARE_KEY not in extra_args:
        return None
    value = extra_args[SHARE_KEY]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"vllm_xargs.{SHARE_KEY}: must be a number in [0, 1] (got {short_repr(value)})")
    force = request_override(extra_args)
    if force != "auto":
        raise ValueError(f"vllm_xargs.{SHARE_KEY}: cannot be combined with {OVERRIDE_KEY}={force!r}")
    return float(value)


def check_allowed(override: str, sa_share: float | None, cfg: ElasticConfig) -> None:
    """Raises ValueError naming the field when the server's ``client_overrides`` does not allow it."""
    allowed = cfg.client_overrides
    if override != "auto" and override not in allowed:
        raise ValueError(
            f"vllm_xargs.{OVERRIDE_KEY}: {override!r} is not allowed by this server "
            f"(elastic.client_overrides = {list(allowed)})"
        )
    if sa_share is not None and SHARE_KEY not in allowed:
        raise ValueError(
            f"vllm_xargs.{SHARE_KEY}: not allowed by this server (elastic.client_overrides = {list(allowed)})"
        )


def validate_sampling_params(params: Any, cfg: ElasticConfig | None = None) -> None:
    """Admission check (API server / LLM process): raises ValueError naming the field. With ``cfg``
    (the server's configuration) the request must also use only the overrides it allows."""
    extra = getattr(params, "extra_args", None)
    override = request_override(extra)
    share = request_sa_share(extra)
    if cfg is not None:
        check_allowed(override, share, cfg)


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


def routing_mode(override: str, sa_share: float | None, server_force: str) -> str:
    """The mode a request runs with, as recorded in ``elastic:requests_total{override}`` and mixed into
    its cache salt: auto, all-FA, all-SA (its own override or the server's force), or sa-share."""
    return "sa-share" if sa_share is not None else effective_force(override, server_force)


def routing_cache_salt(extra_args: dict[str, Any] | None, cfg: ElasticConfig, cfg_digest: str) -> str:
    """The part of a request's cache salt that its routing mode decides (see the module docstring). An
    invalid or disallowed override was refused before this runs; here it counts as the server's default,
    as in the engine."""
    try:
        override, share = request_override(extra_args), request_sa_share(extra_args)
        check_allowed(override, share, cfg)
    except ValueError:
        override, share = "auto", None
    mode = routing_mode(override, share, cfg.force)
    if share is not None:
        mode = f"{mode}={share!r}"
    return f"elastic:{mode}:{cfg_digest}"


def salted(client_salt: str | None, routing_salt: str) -> str:
    """The request's cache_salt: the client's own (isolation between tenants), then the routing part."""
    return f"{client_salt}|{routing_salt}" if client_salt else routing_salt


def effective_force(override: str, server_force: str) -> str:
    """What a request runs with: its own override, or the server's ``force`` when it says auto."""
    return server_force if override == "auto" else override
