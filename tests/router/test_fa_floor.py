"""The fail-safe floor (``ElasticConfig.fa_floor``): its validation, the ranking a router checkpoint stores (older
checkpoints keep loading; a floor without a ranking fails naming the command that adds one), and the transformers
integration routing through the policy with it. The vLLM paths: tests/test_routing_policy.py (glue),
tests/kernels/test_route.py (fused kernel), tests/vllm_cpu/test_units.py (engine state, tensor parallel) and
tests/vllm_cpu/test_fa_floor_engine.py (a real engine)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_sa_margin import tiny_elastic

from elastic_vllm.config import FA_FLOOR_DEFAULT, ConfigError, ElasticConfig
from elastic_vllm.router import policy
from elastic_vllm.router.checkpoint import (
    BackboneMeta,
    RetrievalRanking,
    RouterCheckpointError,
    RouterMeta,
    add_ranking,
    load_router,
    save_router,
)
from elastic_vllm.router.model import ElasticRouter, budget_sa_counts, decide
from elastic_vllm.router.policy import floor_mask, floor_of, route_heads


@pytest.mark.parametrize(
    "value, msg",
    [
        (-1, "a count of heads must be >= 0"),
        (1.0, r"a share of heads must be in \(0, 1\)"),
        (9.0, r"a share of heads must be in \(0, 1\)"),
        (0.0, r"a share of heads must be in \(0, 1\)"),
        (float("nan"), r"a share of heads must be in \(0, 1\)"),
        (True, "must be a number"),
        ("9", "must be a number"),
        ([9], "must be a number"),
    ],
)
def test_fa_floor_is_validated_naming_the_field(value, msg):
    with pytest.raises(ConfigError, match=rf"elastic\.fa_floor: .*{msg}"):
        ElasticConfig.parse({"fa_floor": value})


def test_fa_floor_values_and_default():
    assert ElasticConfig().fa_floor is None and ElasticConfig.parse({"fa_floor": None}).fa_floor is None
    assert isinstance(FA_FLOOR_DEFAULT, float) and 0.0 <= FA_FLOOR_DEFAULT < 1.0  # a share: any model's size
    assert ElasticConfig.parse({"fa_floor": 9}).fa_floor == 9 and isinstance(ElasticConfig(fa_floor=9).fa_floor, int)
    assert ElasticConfig.parse('{"fa_floor": 0.1}').fa_floor == 0.1
    # the floor is a serving knob beside a force or a budget (a force overrides it, a budget takes it last)
    assert ElasticConfig(fa_floor=3, force="all-SA").fa_floor == 3
    assert ElasticConfig(fa_floor=3, target_omega=0.5).target_omega == 0.5


def _router(tmp_path, layers=3, heads=2, d=16, scores=None):
    torch.manual_seed(0)
    meta = RouterMeta(backbone=BackboneMeta(num_layers=layers, num_kv_heads=heads, head_dim=d, id="tiny"))
    path = save_router(ElasticRouter(layers, d), tmp_path / "r", meta)
    if scores is not None:
        add_ranking(path, RetrievalRanking(scores=scores, calibration={"prompts": 2, "haystack": "test text"}))
    return path


def test_checkpoint_stores_the_ranking_and_older_ones_load(tmp_path):
    path = _router(tmp_path)
    weights = (path / "router.safetensors").read_bytes()
    old = load_router(path)  # no ranking: loads, and a floor of 0 needs none
    assert old.meta.retrieval is None and old.router.retrieval_scores is None
    assert floor_of(old.router, ElasticConfig()) is None
    with pytest.raises(
        ConfigError, match=rf"fa_floor 2 needs the retrieval-head ranking .*elastic-vllm router-rank {path}"
    ):
        floor_of(old.router, ElasticConfig(fa_floor=2), path)
    scores = [[0.1, 0.5], [0.0, 0.3], [0.9, 0.2]]
    add_ranking(path, RetrievalRanking(scores=scores, calibration={"prompts": 2}))
    assert (path / "router.safetensors").read_bytes() == weights  # the weights (and their sha256) stay
    ck = load_router(path)
    assert ck.meta.retrieval.calibration == {"prompts": 2} and "needle" in ck.meta.retrieval.method
    assert torch.equal(ck.router.retrieval_scores, torch.tensor(scores))
    assert floor_of(ck.router, ElasticConfig(fa_floor=2)).tolist() == [[False, True], [False, False], [True, False]]
    share = floor_of(ck.router, ElasticConfig(fa_floor=0.5))  # round-half-up(0.5 x 6) = 3 heads
    assert int(share.sum()) == 3 and share[1, 1]
    with pytest.raises(ConfigError, match=r"elastic\.fa_floor: 7 heads, but the model has 3 x 2 = 6"):
        floor_of(ck.router, ElasticConfig(fa_floor=7))


def test_unset_floor_is_the_default_where_the_router_holds_a_ranking(tmp_path, monkeypatch):
    """Unset: the default share where the router holds a ranking, off (and said so) where it holds none; set: the
    value, and a set floor > 0 without a ranking is refused."""
    monkeypatch.setattr(policy, "FA_FLOOR_DEFAULT", 0.5)
    bare = load_router(_router(tmp_path / "a")).router
    ranked = load_router(_router(tmp_path / "b", scores=[[0.1, 0.5], [0.0, 0.3], [0.9, 0.2]])).router
    unset, off, two = ElasticConfig(), ElasticConfig(fa_floor=0), ElasticConfig(fa_floor=2)
    assert policy.floor_value(ranked, unset) == 0.5 and policy.floor_value(bare, unset) == 0
    assert policy.floor_value(ranked, off) == 0 and policy.floor_value(bare, two) == 2
    assert policy.floor_value(None, unset) == 0
    mask = floor_of(ranked, unset)  # round-half-up(0.5 x 6) = 3: the 3 highest scores
    assert mask.tolist() == [[False, True], [False, True], [True, False]]
    assert floor_of(bare, unset) is None and floor_of(ranked, off) is None and floor_of(None, two) is None
    assert policy.describe_floor(ranked, unset, mask) == "fa_floor: 3 of 6 KV heads FA (default 0.5)"
    assert "off (default 0.5, the router holds no retrieval ranking" in policy.describe_floor(bare, unset, None)
    assert policy.describe_floor(ranked, off, None) == "fa_floor: off (set)"
    assert policy.describe_floor(ranked, two, floor_of(ranked, two)) == "fa_floor: 2 of 6 KV heads FA (set)"
    with pytest.raises(ConfigError, match="fa_floor 2 needs the retrieval-head ranking"):
        floor_of(bare, two)


@pytest.mark.parametrize(
    "scores, msg",
    [([[0.1, 0.5], [0.0, 0.3]], r"retrieval\.scores must be \[3 layers\]\[2 KV heads\]"),
     ([[0.1], [0.0], [0.9]], r"retrieval\.scores must be \[3 layers\]\[2 KV heads\]"),
     ([[0.1, 0.5], [0.0, math.nan], [0.9, 0.2]], "NaN or inf")],
)  # fmt: skip
def test_bad_rankings_are_refused(tmp_path, scores, msg):
    path = _router(tmp_path)
    with pytest.raises(RouterCheckpointError, match=msg):
        add_ranking(path, RetrievalRanking(scores=scores))
    meta = json.loads((path / "router.json").read_text())  # written by hand: refused at load
    meta["retrieval"] = {"scores": scores}
    (path / "router.json").write_text(json.dumps(meta, allow_nan=True))
    with pytest.raises(RouterCheckpointError, match=msg):
        load_router(path)


def _set_scores(router, scores):
    router.retrieval_scores = torch.tensor(scores, dtype=torch.float32)


def test_transformers_routing_keeps_the_floor_heads_fa():
    """Through the policy: every row FA on the floor's heads, the rest the router's; Omega_MSR falls by the floor
    heads the router sent to SA; a force overrides the floor; a fixed budget stays exact, taking floor heads last."""
    model, state, router, ids = tiny_elastic()  # 3 layers x 2 KV heads
    model(input_ids=ids)
    plain = state.last_routing.clone()
    z = state.last_logits.clone()
    assert not plain.all()  # the router sends some heads SA
    # rank the heads the router sends SA (in row 0) first, so the floor changes the routing
    scores = (~plain[0]).float() + torch.arange(6, dtype=torch.float32).view(3, 2) * 0.01
    _set_scores(router, scores.tolist())
    with pytest.raises(ConfigError, match="router-rank"):
        type(state)(
            cfg=ElasticConfig(fa_floor=1), num_layers=3, num_kv_heads=2, head_dim=16, router=ElasticRouter(3, 16)
        )
    state.set_config(fa_floor=2)
    floor = floor_mask(scores, 2)
    assert torch.equal(state.floor, floor)
    model(input_ids=ids)
    got = state.last_routing
    assert got[:, floor].all()
    # layer 0's keys do not depend on the routing, later layers' do: the reference is the policy on this run's logits
    for layer in range(3):
        want = route_heads(state.last_logits[:, layer], state.cfg, floor=floor[layer]).fa
        assert torch.equal(got[:, layer], want), layer
    assert torch.equal(state.last_logits[:, 0], z[:, 0])
    assert torch.equal(got[:, 0], decide(z[:, 0]) | floor[0])
    assert (state.omega_msr() < (~plain).float().mean(dim=(1, 2))).all()
    state.set_config(force="all-SA")
    model(input_ids=ids)
    assert not state.last_routing.any()  # a force is explicit: over the floor
    state.set_config(force="auto", target_omega=0.5)
    model(input_ids=ids)
    counts = budget_sa_counts(0.5, 3, 0, 1, 2)
    assert (~state.last_routing).flatten(1).sum(1).tolist() == [sum(counts)] * 2  # exact, floor or not
    for layer in range(3):
        want = route_heads(state.last_logits[:, layer], state.cfg, budget=torch.tensor([counts[layer]] * 2),
                           floor=floor[layer]).fa  # fmt: skip
        assert torch.equal(state.last_routing[:, layer], want), layer
        if counts[layer] <= int((~floor[layer]).sum()):  # room left: the floor heads stay FA
            assert state.last_routing[:, layer][:, floor[layer]].all()


def test_router_rank_cli_stores_the_ranking(tmp_path):
    """``elastic-vllm router-rank ROUTER_DIR --model MODEL_DIR`` on an existing checkpoint (the tiny llama's)."""
    from elastic_vllm.cli import main
    from elastic_vllm.hf.testing import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "m")
    path = _router(tmp_path)
    hay = tmp_path / "hay.txt"
    hay.write_text(
        " ".join(f"Sentence {i} tells of the {w} near the river." for i, w in enumerate(["oak", "fox"] * 60))
    )
    argv = ["router-rank", str(path), "--model", str(model), "--lengths", "300", "--per-length", "2", "--haystack"]
    assert main([*argv, str(hay)]) == 0
    ck = load_router(path)
    assert ck.router.retrieval_scores.shape == (3, 2) and (ck.router.retrieval_scores > 0).any()
    assert ck.meta.retrieval.calibration["model"] == "m" and ck.meta.retrieval.calibration["prompts"] == 2
    # a model of another shape is refused before anything is measured
    other = save_tiny_model("llama", tmp_path / "m4", layers=4)
    assert main([*argv[:3], str(other), *argv[4:], str(hay)]) == 2
