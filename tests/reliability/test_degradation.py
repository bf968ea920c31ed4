"""No silent degradation, and the per-request budget knob bounded, below the server:

- NaN / inf router logits send the head to FA (not SA, as argmax and NaN comparisons did), the engine
  counts them and warns once;
- no PROMETHEUS_MULTIPROC_DIR: one warning at startup that the elastic: metrics cannot reach /metrics;
  a missing or read-only folder: an error naming it;
- a router trained with another sink / window / mode than the server's: a warning naming both;
- copies of one shipped router in several search folders resolve to the first in the documented order
  (and the choice is logged); different routers for one model still stop startup;
- the budget tables of ``elastic_target_omega`` stay bounded whatever floats clients send.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from elastic_vllm.config import ConfigError, ElasticConfig
from elastic_vllm.router.checkpoint import BackboneShape
from elastic_vllm.router.model import decide

from .startup_cases import HEAD_DIM, KV_HEADS, LAYERS, save_router

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "router_weights" / "smollm2-135m-instruct"
SHAPE = BackboneShape(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
MODEL = "SmolLM2-135M-Instruct"
LOGGER = "elastic_vllm.vllm_plugin"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Every test sees the once-only warnings afresh (without precheck each test fails on its own)."""
    try:
        from elastic_vllm.vllm_plugin.precheck import _warned
    except ImportError:
        _warned = set()
    _warned.clear()
    yield
    _warned.clear()


def test_nonfinite_logits_route_to_fa():
    nan, inf = math.nan, math.inf
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [nan, 0.0], [0.0, nan], [inf, 0.0], [0.0, -inf], [nan, nan]])
    assert decide(logits).tolist() == [True, False, True, True, True, True, True]
    assert decide(torch.tensor([[0.5, 0.5]])).tolist() == [False]  # ties stay SA (torch.argmax)


def _nan_router_routing(rows, budget_sa=None):
    """Route ``rows`` through 2 layers of a router whose layer 1 outputs NaN: (logits [R, L, H, 2], fa [R, L, H])."""
    from elastic_vllm.reference.rope import RopeSpec
    from elastic_vllm.router.model import ElasticRouter
    from elastic_vllm.vllm_plugin.routing import build_route_batch, route_layer

    torch.manual_seed(0)
    router = ElasticRouter(2, 8)
    with torch.no_grad():
        router.layers[1].cls_router_head_agnostic[4].bias.fill_(math.nan)  # layer 1 outputs NaN
    key_cache = torch.randn(4, 16, 2, 8)  # [blocks, block_size, KV heads, D]
    table = torch.tensor([[0, 1, 2]] * len(rows))
    rb = build_route_batch(rows, table, 16, "boundary", 4, budget_sa)
    rope = RopeSpec(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), 1.0, 8, 8)
    per_layer = [route_layer(layer, key_cache, rb, router, rope, ElasticConfig(), 2) for layer in range(2)]
    return torch.stack([out[0] for out in per_layer], 1), torch.stack([out[1].fa for out in per_layer], 1)


def test_router_with_nan_output_runs_fa_and_is_counted(caplog):
    from elastic_vllm.vllm_plugin import observe
    from elastic_vllm.vllm_plugin.parallel import Topology
    from elastic_vllm.vllm_plugin.recording import Recorder
    from elastic_vllm.vllm_plugin.requests import RequestState
    from elastic_vllm.vllm_plugin.routing import RouteRow

    logits, fa = _nan_router_routing([RouteRow(0, 40, "auto", False, 0)])
    assert fa[0, 1].all(), "NaN logits must give FA"
    recorder = Recorder(ElasticConfig(), "m", Topology(layers=(0, 2)), (0, 1), True, "r")
    pending = [RequestState("req-1", 40, "auto", "auto")]
    before = observe.COUNTERS.nonfinite_router_heads
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        recorder._count_nonfinite(pending, logits, fa)
        recorder._count_nonfinite(pending, logits, fa)
    assert observe.COUNTERS.nonfinite_router_heads - before == 2 * 2  # 2 heads of layer 1, twice
    warnings = [r for r in caplog.records if "NaN / inf logits" in r.getMessage()]
    assert len(warnings) == 1 and "req-1" in warnings[0].getMessage()


@pytest.mark.parametrize(
    "row,state,counted",
    [
        # a budget that needs every head of layer 1 in SA: the NaN heads ran SA, nothing to count
        ({"target": 1.0}, {"knobs_target": 1.0}, 0),
        # a budget of one SA head per layer: of layer 1's two NaN heads one ran SA, one FA
        ({"target": 0.5}, {"knobs_target": 0.5}, 1),
        # a forced request: its heads never followed the router
        ({"force": "all-SA"}, {"override": "all-SA"}, 0),
        ({"force": "all-FA"}, {"override": "all-FA"}, 0),
    ],
)
def test_nonfinite_counter_counts_only_heads_that_ran_fa_for_it(row, state, counted):
    """elastic:router_nonfinite_heads_total counts the heads that ran FA because of NaN / inf router logits, not
    the ones a budget sent to SA anyway, nor those of a forced request (whose logits the router still computes when
    it runs for other rows of the step)."""
    from elastic_vllm.router.model import budget_sa_counts
    from elastic_vllm.vllm_plugin import observe
    from elastic_vllm.vllm_plugin.overrides import Knobs
    from elastic_vllm.vllm_plugin.parallel import Topology
    from elastic_vllm.vllm_plugin.recording import Recorder
    from elastic_vllm.vllm_plugin.requests import RequestState
    from elastic_vllm.vllm_plugin.routing import RouteRow

    rows = [
        RouteRow(0, 40, "auto", False, 0),
        RouteRow(1, 40, row.get("force", "auto"), False, 1, target=row.get("target")),
    ]
    logits, fa = _nan_router_routing(rows, lambda t: budget_sa_counts(t, 2, group_heads=2))
    assert not torch.isfinite(logits[1, 1]).any()  # the row's layer-1 heads: NaN logits
    assert (
        int(fa[1, 1].sum())
        == {"auto": 2 - round(2 * row.get("target", 0)), "all-SA": 0, "all-FA": 2}[row.get("force", "auto")]
    )
    force = state.get("override", "auto")
    st = RequestState("req-2", 40, force, force, knobs=Knobs(target=state.get("knobs_target")))
    recorder = Recorder(ElasticConfig(), "m", Topology(layers=(0, 2)), (0, 1), True, "r")
    before = observe.COUNTERS.nonfinite_router_heads
    recorder._count_nonfinite([st], logits[1:], fa[1:])
    assert observe.COUNTERS.nonfinite_router_heads - before == counted


def test_missing_metrics_dir_env_warns_once(caplog):
    from elastic_vllm.vllm_plugin.precheck import check_metrics_dir

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert check_metrics_dir({}) is None
        assert check_metrics_dir({}) is None
    lines = [r.getMessage() for r in caplog.records if "PROMETHEUS_MULTIPROC_DIR is not set" in r.getMessage()]
    assert len(lines) == 1 and "/metrics" in lines[0] and "elastic-vllm serve" in lines[0]


def test_offline_llm_is_not_warned_about_metrics(caplog):
    from elastic_vllm.vllm_plugin.precheck import check_metrics_dir

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert check_metrics_dir({}, http=False) is None
    assert not caplog.records


def test_bad_metrics_dir_is_an_error_naming_it(tmp_path):
    from elastic_vllm.vllm_plugin.precheck import check_metrics_dir

    assert check_metrics_dir({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) == tmp_path
    with pytest.raises(ConfigError, match=r"PROMETHEUS_MULTIPROC_DIR=.*gone is not a folder"):
        check_metrics_dir({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "gone")})
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not __import__("os").access(ro, __import__("os").W_OK):  # root writes anywhere
            with pytest.raises(ConfigError, match="is not writable"):
                check_metrics_dir({"PROMETHEUS_MULTIPROC_DIR": str(ro)})
        else:
            ro_file = tmp_path / "file"
            ro_file.write_text("x")
            with pytest.raises(ConfigError, match="is not a folder"):
                check_metrics_dir({"PROMETHEUS_MULTIPROC_DIR": str(ro_file)})
    finally:
        ro.chmod(0o700)


def test_router_trained_with_other_sink_window_warns(caplog):
    from elastic_vllm.router.checkpoint import read_meta
    from elastic_vllm.vllm_plugin.precheck import check_router_training

    meta = read_meta(SHIPPED)  # trained with sink 128, window 512
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        check_router_training(meta.attention, ElasticConfig(sink=128, window=512), SHIPPED)
        assert not caplog.records
        check_router_training(meta.attention, ElasticConfig(sink=4, window=16), SHIPPED)
        check_router_training(meta.attention, ElasticConfig(sink=4, window=16), SHIPPED)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert "sink 128 (serving 4)" in msgs[0] and "window 512 (serving 16)" in msgs[0]


def test_copies_of_the_shipped_router_resolve_by_search_order(tmp_path, monkeypatch, caplog):
    from elastic_vllm.router.discovery import ROUTER_DIR_ENV, find_shipped_router, resolve_router_path

    env_dir, cwd = tmp_path / "env", tmp_path / "cwd"
    shutil.copytree(SHIPPED, env_dir / "copy-in-env")
    shutil.copytree(SHIPPED, cwd / "router_weights" / "copy-in-cwd")
    monkeypatch.setenv(ROUTER_DIR_ENV, str(env_dir))
    monkeypatch.chdir(cwd)
    assert find_shipped_router(SHAPE, MODEL) == env_dir / "copy-in-env"  # $ELASTIC_VLLM_ROUTER_WEIGHTS first
    monkeypatch.delenv(ROUTER_DIR_ENV)
    assert find_shipped_router(SHAPE, MODEL) == SHIPPED  # then the checkout's router_weights/, then ./
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert resolve_router_path(ElasticConfig(), SHAPE, MODEL) == SHIPPED
    assert any(str(SHIPPED) in r.getMessage() and "in this order" in r.getMessage() for r in caplog.records)


def test_different_routers_for_one_model_still_refuse(tmp_path, monkeypatch):
    from elastic_vllm.router.discovery import ROUTER_DIR_ENV, find_shipped_router

    other = save_router(tmp_path / "env" / "other", seed=3)  # same backbone id and shape, other weights
    monkeypatch.setenv(ROUTER_DIR_ENV, str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="several shipped routers match") as e:
        find_shipped_router(SHAPE, MODEL)
    assert str(other) in str(e.value) and str(SHIPPED) in str(e.value)


def test_budget_tables_stay_bounded():
    from elastic_vllm.vllm_plugin.state import BUDGET_TABLES, EngineState

    st = SimpleNamespace(budget_tables={}, num_layers=LAYERS, kv_heads=(0, 1, 2), shape=SimpleNamespace(num_kv_heads=3))
    for i in range(1000):
        counts = EngineState.budget_counts(st, i / 1000)
        assert len(counts) == LAYERS and sum(counts) == math.floor(i / 1000 * LAYERS * 3 + 0.5)
        assert len(st.budget_tables) <= BUDGET_TABLES
    assert EngineState.budget_counts(st, 0.0) == [0] * LAYERS  # evicted long ago: rebuilt, not a stale entry
