"""The load-adaptive bias (``load_policy``): its math (monotone, bounded, smoothed, quantized), which requests it
stamps, and a real CPU engine under a backlog (test_elasticity_engine.py has the per-request knobs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastic_vllm.config import ElasticConfig, LoadPolicy
from elastic_vllm.router.model import decide, effective_margin
from elastic_vllm.vllm_plugin import load_policy as lp
from elastic_vllm.vllm_plugin.overrides import LOAD_BIAS_KEY

from .conftest import close_llm, make_llm, state_of
from .helpers import event_of, greedy

POLICY = LoadPolicy(enabled=True, max_bias=8.0, low=1.0, high=5.0, ema=0.25, levels=4)


def test_bias_level_is_monotone_bounded_and_quantized():
    backlogs = [x / 10 for x in range(0, 100)]
    levels = [lp.bias_level(b, POLICY) for b in backlogs]
    assert levels == sorted(levels)  # monotone
    assert levels[0] == 0.0 and lp.bias_level(1.0, POLICY) == 0.0  # nothing up to low
    assert lp.bias_level(5.0, POLICY) == 8.0 and lp.bias_level(1e9, POLICY) == 8.0  # max_bias from high, never above
    assert set(levels) == {0.0, 2.0, 4.0, 6.0, 8.0}  # levels + 1 values: multiples of max_bias / levels
    assert lp.bias_level(2.9, POLICY) == 2.0 and lp.bias_level(3.0, POLICY) == 4.0  # rounded down, 3.0 on an edge


def test_policy_smooths_rises_with_load_and_falls_when_it_drains():
    p = lp.LoadPolicy(ElasticConfig(load_policy=POLICY), "m", max_batched_tokens=100)
    # one spike of 16 steps of backlog: unsmoothed that is past high (8.0); smoothed, ema = 0.25 x 16 = 4 -> 6.0
    assert p.observe(1600) == 6.0 and p.ema == pytest.approx(4.0)
    p = lp.LoadPolicy(ElasticConfig(load_policy=POLICY), "m", max_batched_tokens=100)
    seen = [p.observe(600) for _ in range(12)]  # backlog 6 steps, held
    assert seen == sorted(seen) and seen[0] == 0.0 and seen[-1] == 8.0
    # EMA weight 0.25: after n steps ema = 6 (1 - 0.75^n): past high (5) from step 7 (5.20), not at step 6 (4.93)
    assert seen.index(8.0) == 6
    falling = [p.observe(0) for _ in range(12)]
    assert falling == sorted(falling, reverse=True) and falling[-1] == 0.0
    p.observe(600)
    p.on_idle()
    assert (p.ema, p.bias) == (0.0, 0.0)


def request(extra=None, salt=None):
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra), cache_salt=salt)


def test_stamp_only_requests_without_a_knob_of_their_own():
    p = lp.LoadPolicy(ElasticConfig(load_policy=POLICY), "m", max_batched_tokens=100)
    idle = request()
    assert p.stamp(idle) == 0.0 and idle.sampling_params.extra_args is None and idle.cache_salt is None
    for _ in range(20):
        p.observe(1000)
    assert p.bias == 8.0
    plain, tenant = request(), request({"x": 1}, salt="tenant|elastic:auto:abc")
    assert p.stamp(plain) == 8.0 and plain.sampling_params.extra_args == {LOAD_BIAS_KEY: 8.0}
    assert plain.cache_salt == "elastic:load-bias=8.0"
    original = tenant.sampling_params.extra_args
    assert p.stamp(tenant) == 8.0 and original == {"x": 1}  # the client's dict is not modified
    assert tenant.cache_salt == "tenant|elastic:auto:abc|elastic:load-bias=8.0"
    # requests with a knob of their own keep it; refused ones (a bad value, a retired key) are not biased either
    for own in ({"elastic_bias": -2.0}, {"elastic_target_omega": 0.5}, {"elastic_force": "all-FA"},
                {"elastic_sa_share": 0.5}, {"elastic_bias": "bad"}):  # fmt: skip
        r = request(dict(own))
        assert p.stamp(r) == 0.0 and r.sampling_params.extra_args == own and r.cache_salt is None


# --- a real engine under load ---------------------------------------------------------------------------------
MAX_BIAS = 1000.0
ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=16, block_size=32, max_model_len=2048)


@pytest.fixture(scope="module")
def loaded_llm(demo_model_dir):
    # ema 1 and high 0.5 steps: one step with any prompt queued beyond it gives the full bias (a test wants the
    # transition, not the smoothing, which the unit tests above cover); the shipped router decides, without the
    # fail-safe floor (the bias is checked against the router's own decision)
    cfg = {"sink": 8, "window": 32, "fa_floor": 0, "load_policy": {"enabled": True, "max_bias": MAX_BIAS, "low": 0.0, "high": 0.5,
                                                     "ema": 1.0, "levels": 1}}  # fmt: skip
    engine = make_llm(demo_model_dir, attention_backend="elastic", additional_config={"elastic": cfg}, **ENGINE)
    yield engine
    close_llm(engine)


def story(i: int) -> str:
    return " ".join(f"Entry {i}.{j}: the ledger moved {j * 13 + i} crates north." for j in range(40))


@pytest.mark.slow
def test_engine_raises_the_bias_under_a_backlog_and_requests_that_chose_keep_theirs(loaded_llm):
    from prometheus_client import REGISTRY

    eng = loaded_llm.llm_engine
    name = state_of(loaded_llm).model_name
    policy = lp.for_config(eng.vllm_config)
    assert policy is not None and policy.cfg.max_bias == MAX_BIAS

    def gauge():
        return REGISTRY.get_sample_value("elastic:load_bias", {"model_name": name})

    def finish():
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
        return outs

    # four long prompts reach an idle engine: no bias; two steps in, ~1,600 prompt tokens (12 steps) are queued
    for i in range(4):
        eng.add_request(f"early-{i}", story(i), greedy(2))
    assert gauge() == 0.0
    eng.step()
    eng.step()
    assert policy.bias == MAX_BIAS and gauge() == MAX_BIAS
    eng.add_request("late", story(9), greedy(2))
    eng.add_request("own-bias", story(10), greedy(2, xargs={"elastic_bias": -3.0}))
    eng.add_request("own-target", story(11), greedy(2, xargs={"elastic_target_omega": 0.5}))
    eng.add_request("forced", story(12), greedy(2, force="all-FA"))
    finish()
    for i in range(4):
        e = event_of(f"early-{i}")
        assert e.force == "auto" and e.bias == 0.0
    late = event_of("late")
    assert late.force == "load-bias" and late.bias == MAX_BIAS
    assert torch.equal(late.decisions, decide(late.logits, effective_margin(0.0, MAX_BIAS)))
    own = event_of("own-bias")
    assert own.force == "bias" and own.bias == -3.0 and own.requested_bias == -3.0
    assert torch.equal(own.decisions, decide(own.logits, effective_margin(0.0, -3.0)))
    tgt = event_of("own-target")
    assert tgt.force == "target-omega" and tgt.omega_msr_all == 45 / 90  # 30 layers x 3 KV heads
    assert event_of("forced").force == "all-FA" and event_of("forced").decisions.all()
    # idle again: the next request starts from no backlog, and does not reuse blocks salted with the load bias
    eng.add_request("after", story(9), greedy(2))
    assert policy.bias == 0.0 and gauge() == 0.0
    outs = finish()
    after = event_of("after")
    assert after.force == "auto" and after.bias == 0.0
    assert outs["after"].num_cached_tokens == 0  # same prompt as "late", another salt
