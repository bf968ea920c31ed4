"""Per-request routing override, sent by clients through vLLM's extra-args channel.

OpenAI API: ``{"vllm_xargs": {"elastic_force": "all-SA"}}`` in the request body; offline:
``SamplingParams(extra_args={"elastic_force": "all-FA"})``. Values: ``auto`` (the server's default,
i.e. its ``force`` setting), ``all-FA``, ``all-SA``. Anything else is rejected at admission
(HTTP 400) with a message naming the field.
"""

from __future__ import annotations

from typing import Any

from elastic_vllm.config import FORCES

OVERRIDE_KEY = "elastic_force"


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


def validate_sampling_params(params: Any) -> None:
    """Admission check (API server / LLM process): raises ValueError naming the field."""
    request_override(getattr(params, "extra_args", None))


def effective_force(override: str, server_force: str) -> str:
    """What a request runs with: its own override, or the server's ``force`` when it says auto."""
    return server_force if override == "auto" else override
