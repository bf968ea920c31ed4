"""Fuzzing of the inputs tests/test_fuzz.py does not reach: the per-request override (``vllm_xargs``,
any JSON a client can send) and the ``additional_config`` of the engine (``elastic`` section plus
``elastic_ops``). tests/test_fuzz.py covers the config parser (ElasticConfig.parse on dicts and raw
strings) and the router checkpoint loader (corrupted weights, fuzzed router.json)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_vllm.config import FORCES, RETIRED_CLIENT_OVERRIDES, ConfigError, ElasticConfig
from elastic_vllm.vllm_plugin.ops import OPS_CHOICES, OPS_ENV, resolve_ops
from elastic_vllm.vllm_plugin.overrides import (
    BIAS_KEY,
    LOAD_BIAS_KEY,
    OVERRIDE_KEY,
    TARGET_KEY,
    effective_force,
    request_knobs,
    request_override,
    validate_sampling_params,
)
from elastic_vllm.vllm_plugin.precheck import parse_additional_config

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from([*FORCES, "ALL-FA", "all_fa", " auto", "all-SA\x00", 0.0, 1.0, -0.0, 0.5, 1, 0, 1024, -1024.0]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)
KEYS = (OVERRIDE_KEY, BIAS_KEY, TARGET_KEY, LOAD_BIAS_KEY, *RETIRED_CLIENT_OVERRIDES, "elastic_forc")


@st.composite
def disguised(draw, key: str) -> str:
    """``key`` as a client may misspell it: letters' case flipped, "_" dropped or made "-", whitespace around."""
    out = []
    for ch in key:
        if ch == "_":
            out.append(draw(st.sampled_from(["_", "", "-", "__"])))
        else:
            out.append(ch.upper() if draw(st.booleans()) else ch)
    return draw(st.sampled_from(["", " ", "\t"])) + "".join(out) + draw(st.sampled_from(["", " ", "\n"]))


key_names = st.sampled_from([*KEYS, "x"]) | st.sampled_from(KEYS).flatmap(disguised) | st.text(max_size=10)
xargs = st.dictionaries(key_names, json_values, max_size=4)


@settings(max_examples=500, deadline=None)
@given(xargs | st.none())
def test_request_override_accepts_or_names_the_field(extra):
    """Any vllm_xargs: accepted with a valid force and knobs, or ValueError naming vllm_xargs.<field>."""
    try:
        validate_sampling_params(SimpleNamespace(extra_args=extra))
    except ValueError as e:
        msg = str(e)
        named = (
            {f"vllm_xargs.{k}: " for k in KEYS}
            | {f"vllm_xargs.{k!r}: " for k in extra}
            | {f"vllm_xargs.{k}: not an elastic-vllm key" for k in extra}
        )
        assert msg.startswith(tuple(named)), msg
        assert "\n" not in msg
        return
    force = request_override(extra)
    assert force in FORCES
    assert effective_force(force, "all-SA") in FORCES
    knobs = request_knobs(extra)  # at most one, finite and in range, only with force auto
    assert knobs.bias is None or knobs.target is None
    if knobs.bias is not None:
        assert isinstance(knobs.bias, float) and math.isfinite(knobs.bias) and abs(knobs.bias) <= 1024
    if knobs.target is not None:
        assert isinstance(knobs.target, float) and 0.0 <= knobs.target <= 1.0
    if knobs.key is not None:
        assert force == "auto"
    assert LOAD_BIAS_KEY not in (extra or {})
    assert not set(RETIRED_CLIENT_OVERRIDES) & set(extra or {})  # a retired key is never accepted
    # nor a misspelt one: every key that reads elastic... once case, whitespace, "_" and "-" are set aside is known
    unknown = [k for k in extra or {} if k.strip().casefold().replace("_", "").replace("-", "").startswith("elastic")]
    assert set(unknown) <= {OVERRIDE_KEY, BIAS_KEY, TARGET_KEY}, unknown


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["elastic", "elastic_ops", "other"]), json_values, max_size=3) | json_values)
def test_additional_config_parses_or_names_the_field(additional):
    """parse_additional_config, then resolve_ops (what EngineState does at startup): a config, or an
    error naming the field (never a TypeError / AttributeError out of the engine's constructor)."""
    vllm_config = SimpleNamespace(additional_config=additional)
    try:
        cfg, ops = parse_additional_config(vllm_config)
    except ConfigError as e:
        assert str(e).startswith("invalid elastic config:"), e
        return
    assert isinstance(cfg, ElasticConfig)
    try:
        resolved = resolve_ops(ops, torch.device("cpu"))
    except ValueError as e:
        assert str(e).startswith(f"elastic_ops / {OPS_ENV}: must be one of"), e
        return
    assert resolved in ("torch", "triton")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(json_values)
def test_resolve_ops_on_any_value(monkeypatch, requested):
    monkeypatch.delenv(OPS_ENV, raising=False)
    try:
        resolved = resolve_ops(requested, torch.device("cpu"))
    except ValueError as e:
        assert "elastic_ops" in str(e)
        return
    assert resolved in ("torch", "triton")
    assert requested in (None, "") or str(requested).lower() in OPS_CHOICES
