"""Every numeric ElasticConfig field is bounded by what the engine can run, and typed strictly.

A value that validates must run: ``{"sink": 1e30}`` validated (as the integer 10**30) and killed the server
on its first long request (OverflowError in the SSA mask); ``"window": true`` was accepted as 1 and
``"router_path": ""`` meant the working directory. Each field: its bound, a bool, a float where an integer
is meant, and the largest accepted value running the reference attention of the backend.
"""

from __future__ import annotations

import math

import pytest
import torch

from elastic_vllm.config import ConfigError, ElasticConfig

MAX_TOKENS = 2**30  # config.MAX_TOKENS (written out: the test must load, and fail, on a config without it)
MAX_XATTN_BLOCK = 4096  # config.MAX_XATTN_BLOCK

# field -> (largest accepted value, smallest refused value above it)
BOUNDS = {
    "sink": (MAX_TOKENS, MAX_TOKENS + 1),
    "window": (MAX_TOKENS, MAX_TOKENS + 1),
    "pool_tokens": (MAX_TOKENS, MAX_TOKENS + 1),
    "xattn_block": (MAX_XATTN_BLOCK, 2 * MAX_XATTN_BLOCK),
    "xattn_stride": (MAX_XATTN_BLOCK, 2 * MAX_XATTN_BLOCK),
}
INT_FIELDS = list(BOUNDS)


def refused(raw: dict, field: str) -> str:
    with pytest.raises(ConfigError) as e:
        ElasticConfig.parse(raw)
    msg = str(e.value)
    assert f"elastic.{field}" in msg, msg
    return msg


def valid(field: str, value) -> dict:
    """A config where only ``field`` varies (xattn_block keeps a multiple of the stride)."""
    raw = {field: value}
    if field == "xattn_stride":
        raw["xattn_block"] = MAX_XATTN_BLOCK
    return raw


@pytest.mark.parametrize("field", INT_FIELDS)
def test_integer_field_upper_bound(field):
    top, over = BOUNDS[field]
    assert getattr(ElasticConfig.parse(valid(field, top)), field) == top
    assert "less than or equal to" in refused(valid(field, over), field)
    refused(valid(field, 10**30), field)


@pytest.mark.parametrize("field", INT_FIELDS)
def test_integer_field_refuses_bools_floats_and_strings(field):
    for bad in (True, False, 1e30, 512.0, "512", None):
        refused(valid(field, bad), field)


@pytest.mark.parametrize("sink", [1e30, 1e18, 2**40])
def test_huge_sink_is_refused_naming_the_field(sink):
    """The issue's config (sink 1e30, window 16, all-SA), and values a lax integer field took (a float
    without a fraction became an int; 2**40 had no bound)."""
    refused({"sink": sink, "window": 16, "force": "all-SA"}, "sink")


def test_xattn_threshold_strict_and_finite():
    for bad in (True, False, math.nan, math.inf, "0.9", 0.0, 1.5):
        refused({"xattn_threshold": bad}, "xattn_threshold")
    assert ElasticConfig.parse({"xattn_threshold": 1}).xattn_threshold == 1.0


def test_router_path_must_name_a_folder():
    for bad in ("", "   ", 1, True):
        refused({"router_path": bad}, "router_path")
    assert ElasticConfig.parse({"router_path": "router_weights/x"}).router_path == "router_weights/x"


def test_bounds_are_the_configs():
    from elastic_vllm import config

    assert (config.MAX_TOKENS, config.MAX_XATTN_BLOCK) == (MAX_TOKENS, MAX_XATTN_BLOCK)


def test_client_overrides_values():
    assert ElasticConfig().client_overrides == (
        "all-FA",
        "all-SA",
        "elastic_bias",
        "elastic_target_omega",
    )  # every per-request override is allowed unless the operator narrows the list
    assert ElasticConfig.parse({"client_overrides": []}).client_overrides == ()
    for bad in (["auto"], ["sparse"], "all-FA", [True], [["elastic_sa_share"]]):
        refused({"client_overrides": bad}, "client_overrides")


@pytest.mark.parametrize("listed", [["elastic_sa_share"], ["all-FA", "elastic_sa_share", "elastic_target_omega"]])
def test_client_overrides_refuse_a_retired_key_naming_its_replacement(listed):
    msg = refused({"client_overrides": listed}, "client_overrides")
    assert "'elastic_sa_share' is no longer supported: use elastic_target_omega" in msg, msg


def test_echoed_value_is_truncated():
    msg = refused({"window": "x" * 5_000_000}, "window")
    assert len(msg) < 300, len(msg)


@pytest.mark.parametrize("field", ["sink", "window"])
def test_largest_token_bound_runs_in_the_attention(field):
    """The largest sink / window the config accepts runs through the backend's SSA attention (the
    torch path of ``vllm_plugin.ops``, the CPU build's): the same output as the widest equivalent
    window (dense causal attention when the window covers the prompt)."""
    from elastic_vllm.vllm_plugin.ops import _fa, _ssa

    torch.manual_seed(0)
    q, k, v = torch.randn(40, 2, 8), torch.randn(40, 1, 8), torch.randn(40, 1, 8)  # [tokens, heads, D]
    sink, window = (MAX_TOKENS, 4) if field == "sink" else (0, MAX_TOKENS)
    torch.testing.assert_close(_ssa(q, k, v, 0, sink, window, 0.35), _fa(q, k, v, 0, 0.35))
