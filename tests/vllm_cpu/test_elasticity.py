"""Test-time elasticity control: ``elastic_bias`` / ``elastic_target_omega`` per request, ``bias`` /
``target_omega`` per deployment. The budget and bias decisions against plain-Python references (exact counts
per request, the tensor-parallel split exact), their validation (each bad value names the field), the cache
salt, and the engine state applying them next to a default request (no engine: test_elasticity_engine.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from elastic_vllm.config import ConfigError, ElasticConfig, HeadMode
from elastic_vllm.reference.rope import RopeSpec
from elastic_vllm.router.model import ElasticRouter, budget_sa_counts, decide, decide_budget, effective_margin
from elastic_vllm.vllm_plugin import observe
from elastic_vllm.vllm_plugin.overrides import (
    Knobs,
    is_load_policy_eligible,
    request_knobs,
    routing_cache_salt,
    routing_mode,
    server_config,
    validate_sampling_params,
)
from elastic_vllm.vllm_plugin.parallel import global_kv_heads
from elastic_vllm.vllm_plugin.state import EngineState

from .routers import save_test_router
from .test_units import BS, HKV, Cached, L, NewReq, PagedSim, SchedOut, fake_vllm_config, run_step


# --- plain-Python references ----------------------------------------------------------------------------------
def ref_layer_counts(target: float, layers: int, heads: int) -> list[int]:
    """SA heads per layer of the whole model: cumulative round-half-up of target x heads per layer."""
    c = [math.floor(target * layer * heads + 0.5) for layer in range(layers + 1)]
    return [c[i + 1] - c[i] for i in range(layers)]


def ref_budget(margins: list[float], n_sa: int) -> list[bool]:
    """FA? of each head: the n_sa lowest margins (ties: lower head) go SA; NaN ranks last."""
    key = [(math.inf if math.isnan(m) or math.isinf(m) else m, h) for h, m in enumerate(margins)]
    sa = {h for _, h in sorted(key)[:n_sa]}
    return [h not in sa for h in range(len(margins))]


def ref_bias(z_fa: float, z_sa: float, sa_margin: float, bias: float) -> bool:
    """FA iff z_FA - z_SA > bias - sa_margin, in float32 (the kernel's threshold is float32)."""
    import numpy as np

    d = np.float32(z_fa) - np.float32(z_sa)
    return bool(d > np.float32(bias - sa_margin))


@pytest.mark.parametrize("target", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 0.333, 1 / 7])
@pytest.mark.parametrize("layers, heads", [(30, 3), (32, 8), (36, 8), (7, 5), (1, 1)])
def test_budget_counts_match_the_reference_and_total_exactly(target, layers, heads):
    counts = budget_sa_counts(target, layers, 0, 1, heads)
    assert counts == ref_layer_counts(target, layers, heads)
    assert sum(counts) == math.floor(target * layers * heads + 0.5)  # round half up of target x all heads
    assert all(0 <= n <= heads for n in counts)
    assert max(counts) - min(counts) <= 1  # spread evenly over the layers


@pytest.mark.parametrize("target", [0.25, 0.5, 0.75, 0.9, 0.3])
@pytest.mark.parametrize("heads, tp", [(8, 2), (8, 4), (8, 8), (4, 8), (3, 3), (2, 4)])
def test_budget_tensor_parallel_split_is_exact(target, heads, tp):
    """Each rank gets its own heads' share with no message; per layer the ranks' counts sum to the TP=1 count,
    and replicas of one head (tp > heads) decide the same."""
    layers = 13
    per_rank = []
    for rank in range(tp):
        kv = global_kv_heads(rank, tp, heads)
        g = len(kv)
        per_rank.append((kv, budget_sa_counts(target, layers, kv[0] // g, heads // g, g)))
    distinct = {tuple(kv): counts for kv, counts in per_rank}  # replicas hold the same heads
    assert len(distinct) == min(tp, heads)
    for kv, counts in per_rank:
        assert distinct[tuple(kv)] == counts and all(0 <= n <= len(kv) for n in counts)
    per_layer = [sum(c[layer] for c in distinct.values()) for layer in range(layers)]
    assert per_layer == ref_layer_counts(target, layers, heads)
    assert sum(per_layer) == math.floor(target * layers * heads + 0.5)


def test_decide_budget_matches_the_reference_with_ties_and_nonfinite_logits():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 8, 2, generator=g).round(decimals=1)  # rounding makes ties
    logits[5, 2, 0] = float("nan")
    logits[9, 7, 1] = float("inf")
    n_sa = torch.randint(0, 9, (64,), generator=g)
    got = decide_budget(logits, n_sa)
    for r in range(64):
        margins = (logits[r, :, 1] - logits[r, :, 0]).tolist()
        assert got[r].tolist() == ref_budget(margins, int(n_sa[r])), r
        assert int((~got[r]).sum()) == int(n_sa[r])  # exact whatever the logits
    assert not got[5, 2] or n_sa[5] < 8  # a NaN head goes SA only when every head must


@pytest.mark.parametrize("sa_margin", [0.0, 1.5, -2.0])
def test_bias_decisions_match_the_reference_and_are_monotone(sa_margin):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 8, 2, generator=g) * 4
    sa_counts = []
    for bias in (-8.0, -1.0, -0.1, 0.0, 0.1, 1.0, 8.0, 1024.0):
        fa = decide(logits, effective_margin(sa_margin, bias))
        want = [[ref_bias(float(z[1]), float(z[0]), sa_margin, bias) for z in row] for row in logits]
        assert fa.tolist() == want, bias
        sa_counts.append(int((~fa).sum()))
        # per-row margins (a batch of requests with different biases) decide the same
        per_row = decide(logits, (sa_margin - torch.full((16, 1), bias, dtype=torch.float64)).float())
        assert torch.equal(per_row, fa)
    assert sa_counts == sorted(sa_counts) and sa_counts[0] < sa_counts[-1]  # bias > 0 sparser, monotone
    assert sa_counts[-1] == 16 * 8  # 1024 routes every head of these logits SA


# --- validation: every bad value names its field --------------------------------------------------------------
BAD = [
    ({"elastic_bias": float("nan")}, r"vllm_xargs.elastic_bias: must be a finite number"),
    ({"elastic_bias": float("inf")}, r"vllm_xargs.elastic_bias: must be a finite number"),
    ({"elastic_bias": 2000}, r"vllm_xargs.elastic_bias: must be in \[-1024, 1024\]"),
    ({"elastic_bias": True}, r"vllm_xargs.elastic_bias: must be a number"),
    ({"elastic_bias": "1"}, r"vllm_xargs.elastic_bias: must be a number"),
    ({"elastic_bias": None}, r"vllm_xargs.elastic_bias: must be a number"),
    ({"elastic_target_omega": 1.5}, r"vllm_xargs.elastic_target_omega: must be in \[0, 1\]"),
    ({"elastic_target_omega": -0.1}, r"vllm_xargs.elastic_target_omega: must be in \[0, 1\]"),
    ({"elastic_target_omega": float("nan")}, r"vllm_xargs.elastic_target_omega: must be a finite number"),
    ({"elastic_target_omega": False}, r"vllm_xargs.elastic_target_omega: must be a number"),
    ({"elastic_target_omega": [0.5]}, r"vllm_xargs.elastic_target_omega: must be a number"),
    ({"elastic_bias": 1, "elastic_target_omega": 0.5}, r"elastic_bias: cannot be combined with elastic_target_omega"),
    ({"elastic_bias": 1, "elastic_force": "all-FA"}, r"elastic_bias: cannot be combined with elastic_force='all-FA'"),
    ({"elastic_target_omega": 0.5, "elastic_force": "all-SA"}, r"elastic_target_omega: cannot be combined with elastic_force='all-SA'"),
    # a retired key is refused naming its replacement, alone or next to a valid knob (never silently ignored)
    ({"elastic_sa_share": 0.5}, r"vllm_xargs.elastic_sa_share: no longer supported; use elastic_target_omega"),
    ({"elastic_target_omega": 0.5, "elastic_sa_share": 0.5}, r"vllm_xargs.elastic_sa_share: no longer supported"),
    ({"elastic_load_bias": 1.0}, r"vllm_xargs.elastic_load_bias: set by the server's load policy"),
    # a misspelt knob is refused naming the known keys (ignored, the request would run the default routing)
    ({"elastic_forc": "all-FA"}, r"vllm_xargs.elastic_forc: not an elastic-vllm key \(known: elastic_force, elastic_bias, elastic_target_omega\)"),
    ({"elastic_target_omega": 0.5, "elastic_target": 0.5}, r"vllm_xargs.elastic_target: not an elastic-vllm key"),
    # the same knob in another case, with spaces around, without its underscore: refused, never run as auto
    ({"ELASTIC_FORCE": "all-SA"}, r"^vllm_xargs.ELASTIC_FORCE: not an elastic-vllm key \(did you mean elastic_force\? known: elastic_force, elastic_bias, elastic_target_omega\)$"),
    ({"Elastic_force": "all-SA"}, r"^vllm_xargs.Elastic_force: not an elastic-vllm key \(did you mean elastic_force\?"),
    ({" elastic_force": "all-SA"}, r"^vllm_xargs.' elastic_force': not an elastic-vllm key \(did you mean elastic_force\?"),
    ({"elastic_force ": "all-SA"}, r"^vllm_xargs.'elastic_force ': not an elastic-vllm key \(did you mean elastic_force\?"),
    ({"elasticforce": "all-SA"}, r"^vllm_xargs.elasticforce: not an elastic-vllm key \(did you mean elastic_force\?"),
    ({"elastic-force": "all-SA"}, r"^vllm_xargs.elastic-force: not an elastic-vllm key \(did you mean elastic_force\?"),
    ({"elasticTargetOmega": 0.5}, r"^vllm_xargs.elasticTargetOmega: not an elastic-vllm key \(did you mean elastic_target_omega\?"),
    ({"\telastic_bias\n": 1.0}, r"^vllm_xargs.'\\telastic_bias\\n': not an elastic-vllm key \(did you mean elastic_bias\?"),
    ({"Elastic": 1}, r"^vllm_xargs.Elastic: not an elastic-vllm key \(known: elastic_force"),
    ({"ELASTIC_SA_SHARE": 0.5}, r"^vllm_xargs.ELASTIC_SA_SHARE: not an elastic-vllm key \(known: elastic_force"),
    ({"elastic_force": "auto", "ELASTIC_FORCE": "all-SA"}, r"^vllm_xargs.ELASTIC_FORCE: not an elastic-vllm key"),
]  # fmt: skip


@pytest.mark.parametrize("extra, msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_knobs_are_refused_naming_the_field(extra, msg):
    with pytest.raises(ValueError, match=msg):
        validate_sampling_params(SimpleNamespace(extra_args=extra), ElasticConfig())


def test_good_knobs_and_server_rules():
    assert request_knobs({"elastic_bias": -3}) == Knobs(bias=-3.0)
    assert request_knobs({"elastic_target_omega": 1, "elastic_force": "auto"}) == Knobs(target=1.0)
    assert request_knobs(None) == Knobs() and request_knobs({"x": 1}) == Knobs()
    assert request_knobs({"my_elastic_force": 1, "temperature_elastic": 2}) == Knobs()  # other keys pass
    closed = ElasticConfig(client_overrides=("all-FA",))
    with pytest.raises(ValueError, match=r"vllm_xargs.elastic_bias: not allowed by this server"):
        validate_sampling_params(SimpleNamespace(extra_args={"elastic_bias": 1.0}), closed)
    forced = ElasticConfig(force="all-SA")
    with pytest.raises(ValueError, match=r"elastic_target_omega: needs the router, but this server runs"):
        validate_sampling_params(SimpleNamespace(extra_args={"elastic_target_omega": 0.5}), forced)


def test_deployment_knobs_are_validated():
    assert ElasticConfig().bias == 0.0 and ElasticConfig().target_omega is None  # defaults: today's routing
    for raw, msg in [
        ({"bias": float("nan")}, "elastic.bias: Input should be a finite number"),
        ({"bias": True}, "elastic.bias: Value error, must be a number"),
        ({"bias": 2048}, "elastic.bias: Input should be less than or equal to 1024"),
        ({"target_omega": 1.01}, "elastic.target_omega: Input should be less than or equal to 1"),
        ({"target_omega": "0.5"}, "elastic.target_omega: Value error, must be a number"),
        ({"bias": 1, "target_omega": 0.5}, "bias and target_omega cannot be combined"),
        ({"force": "all-FA", "target_omega": 0.5}, "target_omega needs the router, but force is 'all-FA'"),
        ({"load_policy": {"enabled": True, "max_bias": 0}}, "elastic.load_policy.max_bias: Input should be greater"),
        ({"load_policy": {"enabled": True, "low": 4, "high": 2}}, "high .* must be greater than low"),
        ({"load_policy": {"enabled": True, "levels": 0}}, "elastic.load_policy.levels"),
        ({"load_policy": {"enabled": True, "ema": 1.5}}, "elastic.load_policy.ema"),
        ({"load_policy": {"enabled": 1}}, "elastic.load_policy.enabled"),
        ({"load_policy": {"enabled": True}, "target_omega": 0.2}, "load_policy cannot be combined with target_omega"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            ElasticConfig.parse(raw)


def test_cache_salt_and_mode_separate_every_knob_value():
    vc = SimpleNamespace(additional_config={"elastic": {"sink": 4}})
    cfg, digest = server_config(vc)

    def salt(extra):
        return routing_cache_salt(extra, cfg, digest)

    salts = [
        salt(None),
        salt({"elastic_bias": 1.0}),
        salt({"elastic_bias": 2.0}),
        salt({"elastic_bias": -1.0}),
        salt({"elastic_target_omega": 0.5}),
        salt({"elastic_target_omega": 0.75}),
        salt({"elastic_force": "all-SA"}),
    ]
    assert len(set(salts)) == len(salts)
    assert salt({"elastic_bias": 1}) == salt({"elastic_bias": 1.0})  # the same value, the same blocks
    assert salts[1] == f"elastic:bias=1.0:{digest}" and salts[4] == f"elastic:target-omega=0.5:{digest}"
    # a server bias / target is part of the configuration digest
    assert server_config(SimpleNamespace(additional_config={"elastic": {"sink": 4, "bias": 1.0}}))[1] != digest
    assert routing_mode("auto", "auto", Knobs(bias=1.0)) == "bias"
    assert routing_mode("auto", "auto", Knobs(target=0.5)) == "target-omega"
    assert routing_mode("auto", "auto", Knobs(), load_bias=2.0) == "load-bias"
    assert routing_mode("auto", "auto") == "auto"
    assert is_load_policy_eligible(None, cfg) and not is_load_policy_eligible({"elastic_bias": 0.0}, cfg)
    assert not is_load_policy_eligible({"elastic_force": "all-FA"}, cfg)


# --- the engine state applies them, next to a default request ---------------------------------------------------
def test_engine_state_applies_bias_and_target_next_to_a_default_request(tmp_path):
    lens = {"T": 300, "B": 200, "D": 250}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope, seed=7)
    torch.manual_seed(7)
    path = save_test_router(ElasticRouter(L, 64), tmp_path / "r", HKV)
    st = EngineState(fake_vllm_config({"elastic": {"router_path": str(path), "pool_tokens": 8, "sink": 4}}))
    st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    observe.clear()
    reqs = [
        NewReq("T", [0] * 300, sampling_params=SimpleNamespace(extra_args={"elastic_target_omega": 0.5})),
        NewReq("B", [0] * 200, sampling_params=SimpleNamespace(extra_args={"elastic_bias": 1e3})),
        NewReq("D", [0] * 250),
    ]
    # chunk 1 of T (prefix routing applies its budget too), whole prompts of B and D
    so = SchedOut(reqs, Cached(), {"T": 100, "B": 200, "D": 250})
    plan, _ = run_step(st, sim, so, ["T", "B", "D"], [100, 200, 250], [100, 200, 250])
    assert plan.route.needs_glue and plan.route.uniform_bias is None
    so = SchedOut([], Cached(["T"], [100]), {"T": 200})
    run_step(st, sim, so, ["T"], [200], [300])
    ev = {r: observe.events(r)[0] for r in lens}
    # T: exactly round(0.5 x L x H) SA heads, the lowest margins of each layer
    t = ev["T"]
    assert t.omega_msr == math.floor(0.5 * L * HKV + 0.5) / (L * HKV)
    for layer, n_sa in enumerate(ref_layer_counts(0.5, L, HKV)):
        margins = (t.logits[layer, :, 1] - t.logits[layer, :, 0]).tolist()
        assert t.decisions[layer].tolist() == ref_budget(margins, n_sa)
    assert t.force == "target-omega" and t.requested_target_omega == 0.5 and t.target_omega == 0.5
    # B: bias 1000 (far past this router's margins): every head SA; D: the router's argmax, unchanged
    assert not ev["B"].decisions.any() and ev["B"].force == "bias" and ev["B"].requested_bias == 1e3
    d = ev["D"]
    assert torch.equal(d.decisions, decide(d.logits)) and d.force == "auto" and d.requested_bias is None
    assert torch.equal(d.head_modes.long(), torch.where(d.decisions, HeadMode.FA, HeadMode.SSA).long())


def test_engine_state_server_knobs_and_the_requests_own(tmp_path):
    """A server bias applies to requests without a knob; a request's own target replaces it."""
    lens = {"S": 120, "O": 120}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope, seed=8)
    torch.manual_seed(8)
    path = save_test_router(ElasticRouter(L, 64), tmp_path / "r", HKV)
    cfg = {"elastic": {"router_path": str(path), "pool_tokens": 8, "sink": 4, "bias": -1e3}}
    st = EngineState(fake_vllm_config(cfg))
    st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    observe.clear()
    own = SimpleNamespace(extra_args={"elastic_target_omega": 1.0})
    so = SchedOut([NewReq("S", [0] * 120), NewReq("O", [0] * 120, sampling_params=own)], Cached(), {"S": 120, "O": 120})
    run_step(st, sim, so, ["S", "O"], [120, 120], [120, 120])
    s, o = observe.events("S")[0], observe.events("O")[0]
    assert s.decisions.all() and s.bias == -1e3 and s.force == "auto"  # server bias -1000: every head FA
    assert not o.decisions.any() and o.omega_msr == 1.0 and o.bias == 0.0  # its own target 1: every head SA
