"""Per-request routing override, sent by clients through vLLM's extra-args channel.

OpenAI API: ``{"vllm_xargs": {"elastic_force": "all-SA"}}`` in the request body; offline:
``SamplingParams(extra_args={"elastic_force": "all-FA"})``. Values: ``auto`` (the server's default,
i.e. its ``force`` setting), ``all-FA``, ``all-SA``. Anything else is rejected at admission
(HTTP 400) with a message naming the field.

Benchmarks only: ``elastic_sa_share`` (a number in [0, 1]) replaces the router's decisions of the request
by a fixed head assignment with that share of SA heads (:func:`routing.fixed_share_fa`). The router
still runs when the request would run it (server ``force`` auto), so its cost stays in the timing.
It cannot be combined with an ``elastic_force`` other than auto.
"""

from __future__ import annotations

from typing import Any

from elastic_vllm.config import FORCES

OVERRIDE_KEY = "elastic_force"
SHARE_KEY = "elastic_sa_share"


def request_override(extra_args: dict[str, Any] | None) -> str:
    """The override of one request: "auto" when absent. Raises ValueError for an unknown value."""
    if not extra_args or OVERRIDE_KEY not in extra_args:
        return "auto"
    value = extra_args[OVERRIDE_KEY]
    if value not in FORCES:
        raise ValueError(
            f"vllm_xargs.{OVERRIDE_KEY}: must be one of {', '.join(repr(f) for f in FORCES)} (got {value!r})"
        )
    return value


def request_sa_share(extra_args: dict[str, Any] | None) -> float | None:
    """The fixed SA share of one request (benchmarks), None when absent. Raises ValueError when it is
    not a number in [0, 1] or comes with an ``elastic_force`` other than auto."""
    if not extra_args or SHARE_KEY not in extra_args:
        return None
    value = extra_args[SHARE_KEY]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"vllm_xargs.{SHARE_KEY}: must be a number in [0, 1] (got {value!r})")
    force = request_override(extra_args)
    if force != "auto":
        raise ValueError(f"vllm_xargs.{SHARE_KEY}: cannot be combined with {OVERRIDE_KEY}={force!r}")
    return float(value)


def validate_sampling_params(params: Any) -> None:
    """Admission check (API server / LLM process): raises ValueError naming the field."""
    extra = getattr(params, "extra_args", None)
    request_override(extra)
    request_sa_share(extra)


def effective_force(override: str, server_force: str) -> str:
    """What a request runs with: its own override, or the server's ``force`` when it says auto."""
    return server_force if override == "auto" else override
