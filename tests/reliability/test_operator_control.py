"""Operator control on the shared `elastic-vllm serve` (default ``client_overrides``: today's
behaviour, every override allowed), and the admission check below the server:

- a 400 echoes at most a short prefix of a bad value (a 5 MB value used to come back whole);
- a fixed-budget request (``elastic_target_omega``) is counted under ``override="target-omega"``, the mode it
  ran with, not as ``auto`` (which would skew the dashboards);
- a retired key (``elastic_sa_share``) is refused with a 400 naming it and its replacement;
- ``client_overrides`` refuses what it does not list, naming the field, at admission and in the engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from .serving import MODEL_NAME, delta

BIG = 5_000_000


@pytest.mark.slow
@pytest.mark.parametrize(
    "xargs,field",
    [({"elastic_force": "x" * BIG}, "elastic_force"), ({"elastic_target_omega": "1" * BIG}, "elastic_target_omega")],
)
def test_400_truncates_the_echoed_value(server, xargs, field):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "vllm_xargs": xargs}
    with httpx.Client(base_url=server.base, timeout=600) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text[:300]
    assert f"vllm_xargs.{field}" in r.text
    assert len(r.content) < 2000, f"a {len(r.content)}-byte 400 body"


@pytest.mark.slow
def test_target_requests_are_counted_as_target_omega(server):
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2, "vllm_xargs": {"elastic_target_omega": 0.5}}
    with httpx.Client(base_url=server.base, timeout=600) as c:
        m0 = server.metrics()
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text[:300]
        m1 = server.metrics()
    assert delta(m0, m1, "elastic:requests_total", override="target-omega") == 1
    assert delta(m0, m1, "elastic:requests_total", override="auto") == 0


@pytest.mark.slow
def test_retired_share_key_is_refused_naming_its_replacement(server):
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2, "vllm_xargs": {"elastic_sa_share": 0.5}}
    with httpx.Client(base_url=server.base, timeout=600) as c:
        m0 = server.metrics()
        r = c.post("/v1/completions", json=body)
        m1 = server.metrics()
    assert r.status_code == 400, r.text[:300]
    assert "vllm_xargs.elastic_sa_share: no longer supported" in r.text and "elastic_target_omega" in r.text, r.text
    assert delta(m0, m1, "elastic:requests_total") == 0  # refused at admission: nothing ran, nothing recorded


def _vllm_config(**elastic):
    return SimpleNamespace(additional_config={"elastic": elastic})


@pytest.mark.parametrize(
    "allowed,xargs,ok",
    [
        (None, {"elastic_force": "all-FA"}, True),  # default: today's behaviour
        (None, {"elastic_target_omega": 0.5}, True),
        ([], {"elastic_force": "all-FA"}, False),
        ([], {"elastic_force": "auto"}, True),
        ([], {"elastic_target_omega": 0.5}, False),
        (["all-SA"], {"elastic_force": "all-SA"}, True),
        (["all-SA"], {"elastic_force": "all-FA"}, False),
        (["all-FA", "all-SA"], {"elastic_bias": 0.25}, False),
    ],
)
def test_admission_enforces_client_overrides(allowed, xargs, ok):
    from elastic_vllm.vllm_plugin.plugin import _validate

    cfg = _vllm_config(force="auto", **({} if allowed is None else {"client_overrides": allowed}))
    params = SimpleNamespace(extra_args=xargs)
    if ok:
        _validate(params, cfg)
    else:
        with pytest.raises(ValueError, match=r"vllm_xargs\.elastic_\w+: .*not allowed.*elastic\.client_overrides"):
            _validate(params, cfg)


def test_cache_salt_separates_modes_and_keeps_the_clients_salt():
    from elastic_vllm.vllm_plugin.plugin import _cache_salt

    cfg = _vllm_config(force="auto")
    salt = lambda xargs, client=None: _cache_salt(SimpleNamespace(extra_args=xargs), cfg, client)  # noqa: E731
    auto, fa, sa = salt(None), salt({"elastic_force": "all-FA"}), salt({"elastic_force": "all-SA"})
    assert len({auto, fa, sa, salt({"elastic_target_omega": 0.5}), salt({"elastic_target_omega": 0.25})}) == 5
    assert salt({"elastic_force": "auto"}) == auto  # explicit auto = the server's default
    assert salt(None, "tenant-a").startswith("tenant-a|") and salt(None, "tenant-a") != salt(None, "tenant-b")
    # a server forcing all-SA: its auto requests run (and share blocks with) all-SA
    forced = _vllm_config(force="all-SA")
    assert _cache_salt(SimpleNamespace(extra_args=None), forced, None) == _cache_salt(
        SimpleNamespace(extra_args={"elastic_force": "all-SA"}), forced, None
    )
    # another server configuration never shares blocks
    assert _cache_salt(SimpleNamespace(extra_args=None), _vllm_config(window=64), None) != auto
