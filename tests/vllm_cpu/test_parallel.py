"""Pipeline (and tensor x pipeline) parallelism of the elastic backend without an engine: stages and TP ranks
as threads, vLLM's stage-to-stage messages and TP all-gather as queues and a barrier; unsupported parallel
modes fail at startup. The real CPU engines (PP=2, TP2 x PP2, DP=2 behind `vllm serve`) are in
test_parallel_engine.py."""

from __future__ import annotations

import math
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from elastic_vllm.config import ConfigError
from elastic_vllm.vllm_plugin import compat, observe, parallel
from elastic_vllm.vllm_plugin.state import EngineState

from .test_units import BS, HKV, Cached, L, NewReq, SchedOut, _RankSim, fake_vllm_config, two_requests_split_router

LENS = {"A": 300, "B": 40}


def _step(state: EngineState, sim, so, rows, lens) -> None:
    """One step as a stage's model runner drives it: only the stage's layers run attention (and route)."""
    state.on_step_begin(so)
    state.on_rows(rows)
    plan = state.plan_step(sim.common(rows, lens, lens))
    if plan.route is not None:
        for li in range(*state.topo.layers):
            state.route(li, sim.key_cache(li), plan.route)
    state.on_step_end()


def _steps(state: EngineState, sim) -> None:
    """Step 1 finalizes A and B; step 2 decodes them (nothing to exchange); step 3 finishes them."""
    so = SchedOut([NewReq("A", [0] * 300), NewReq("B", [0] * 40)], Cached(), dict(LENS))
    _step(state, sim, so, ["A", "B"], [300, 40])
    so = SchedOut([], Cached(["A", "B"], [300, 40]), {"A": 1, "B": 1})
    state.on_step_begin(so)
    state.on_rows(["A", "B"])
    state.plan_step(sim.common(["A", "B"], [1, 1], [301, 41]))
    state.on_step_end()
    state.on_step_begin(SchedOut([], Cached(), {}, finished_req_ids={"A", "B"}))
    state.on_step_end()


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2xpp2"])
def test_pipeline_stages_assemble_the_omegas_on_the_last_stage(tmp_path, monkeypatch, tp):
    """PP=2 (one layer per stage) and TP2 x PP2: each stage routes its own layer, its decisions equal one
    process's for that layer, and the last stage's TP rank 0 records the Omegas over every layer and head
    (equal to one process's) once; stage 0's own shares differ from them. Stage 0 runs all its steps to the
    end BEFORE the last stage starts: its send never waits for a later stage (a collective over the pipeline
    at step end would deadlock in vLLM, which sends activations to the next stage after it)."""
    from prometheus_client import REGISTRY

    sim, cfg = two_requests_split_router(tmp_path)  # 2 layers: one per stage

    observe.clear()
    single = EngineState(fake_vllm_config(cfg))
    single.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    _steps(single, sim)
    want = {e.req_id: e for e in observe.events()}
    assert want["A"].decisions.tolist() == [[True, True], [True, False]]  # Omega_MSR 1/4; stage 0 alone: 0
    assert want["B"].decisions.tolist() == [[False, False], [True, False]]

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0

    def per_layer(layer):
        return sum(sample("elastic:head_decisions_total", layer=str(layer), decision=d, tp_rank=str(t))
                   for d in ("FA", "SA") for t in range(tp))  # fmt: skip

    before = {
        "msr_n": sample("elastic:request_omega_msr_count"),
        "msr_sum": sample("elastic:request_omega_msr_sum"),
        "esr_sum": sample("elastic:request_omega_esr_sum"),
        "lat_n": sum(sample("elastic:router_latency_seconds_count", tp_rank=str(t)) for t in range(tp)),
        "layers": [per_layer(li) for li in range(L)],
    }
    observe.clear()
    me = threading.local()
    mailboxes: dict[tuple[int, int], queue.Queue] = {(t, s): queue.Queue() for t in range(tp) for s in range(2)}
    gathers: dict[int, list] = {s: [None] * tp for s in range(2)}
    barriers = {s: threading.Barrier(tp, timeout=60) for s in range(2)}
    sends, recvs = [], []

    def isend(payload, dst_stage, tag):
        assert tag == parallel.PP_TAG and dst_stage == 1
        sends.append((me.pp, me.tp))
        mailboxes[(me.tp, me.pp)].put(payload)
        return []

    def recv(src_stage, tag):
        recvs.append((me.pp, me.tp))
        return mailboxes[(me.tp, src_stage)].get(timeout=60)

    def all_gather(obj):
        g, b = gathers[me.pp], barriers[me.pp]
        g[me.tp] = obj
        b.wait()
        out = list(g)
        b.wait()
        return out

    monkeypatch.setattr(compat, "tp_rank_and_size", lambda: (me.tp, tp))
    monkeypatch.setattr(compat, "pp_rank_and_size", lambda: (me.pp, 2))
    monkeypatch.setattr(compat, "pp_isend_bytes", isend)
    monkeypatch.setattr(compat, "pp_recv_bytes", recv)
    monkeypatch.setattr(compat, "tp_all_gather_object", all_gather)
    live = []
    monkeypatch.setattr("elastic_vllm.telemetry.metrics.set_live_requests", lambda m, t, n: live.append((me.pp, t, n)))

    def run_rank(pp, t):
        me.pp, me.tp = pp, t
        vc = fake_vllm_config(cfg)
        vc.model_config.get_num_kv_heads = lambda pc: HKV // tp
        state = EngineState(vc)
        assert state.topo.layers == (pp, pp + 1)  # vLLM's get_pp_indices: one layer per stage
        state.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
        _steps(state, _RankSim(sim, list(state.kv_heads)))

    for pp in range(2):  # stage 0 to its end first, then the last stage
        with ThreadPoolExecutor(tp) as pool:
            for f in [pool.submit(run_rank, pp, t) for t in range(tp)]:
                f.result()
    assert sorted(sends) == [(0, t) for t in range(tp)]  # one message per rank of stage 0, on the final step
    assert sorted(recvs) == [(1, t) for t in range(tp)]
    events = observe.events()
    assert len(events) == 2 * 2 * tp
    for e in events:
        w = want[e.req_id]
        h = list(e.kv_heads)
        assert e.first_layer == e.pp_rank and e.decisions.shape == (1, len(h))
        assert torch.equal(e.decisions, w.decisions[e.pp_rank : e.pp_rank + 1, h])
        if e.last_stage:
            assert e.omega_msr_all == pytest.approx(w.omega_msr, abs=1e-12)
            assert e.omega_esr_all == pytest.approx(w.omega_esr, abs=1e-12)
        else:  # stage 0 sends its counts on and never learns the totals
            assert math.isnan(e.omega_msr_all) and math.isnan(e.omega_esr_all)
    stage0_own = {e.req_id: e.omega_msr for e in events if e.pp_rank == 0 and e.tp_rank == 0}
    assert stage0_own["A"] != want["A"].omega_msr  # a stage's own share alone would be wrong
    # the last stage's rank 0 records each request once, over every layer and head; each layer counted once
    assert sample("elastic:request_omega_msr_count") == before["msr_n"] + 2
    assert sample("elastic:request_omega_msr_sum") == pytest.approx(
        before["msr_sum"] + sum(e.omega_msr for e in want.values())
    )
    assert sample("elastic:request_omega_esr_sum") == pytest.approx(
        before["esr_sum"] + sum(e.omega_esr for e in want.values())
    )
    assert (
        sum(sample("elastic:router_latency_seconds_count", tp_rank=str(t)) for t in range(tp))
        == before["lat_n"] + 2 * tp
    )
    assert [per_layer(li) - before["layers"][li] for li in range(L)] == [2 * HKV] * L
    # live requests: published by the last stage only, back to 0
    assert {s for s, _, _ in live} == {1} and [n for s, t, n in live if t == 0] == [2, 0]


def test_unsupported_parallel_modes_fail_at_startup():
    base = dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    vc = fake_vllm_config({})
    vc.parallel_config = SimpleNamespace(**base)
    parallel.check_parallel_support(vc)  # TP, PP, DP: supported
    for knob, value, name in [
        ("enable_expert_parallel", True, "expert parallelism"),
        ("decode_context_parallel_size", 2, "decode context parallelism"),
        ("prefill_context_parallel_size", 2, "prefill context parallelism"),
        ("enable_dbo", True, "micro-batching"),
        ("ubatch_size", 2, "micro-batching"),
    ]:
        vc.parallel_config = SimpleNamespace(**base, **{knob: value})
        with pytest.raises(ConfigError, match=rf"elastic: {name} .*not supported.*--pipeline-parallel-size"):
            EngineState(vc)


def test_a_stage_holding_other_layers_than_vllms_split_fails():
    topo = parallel.Topology(0, 1, 1, 2, (1, 2))
    parallel.check_stage_layers(topo, ["model.layers.1.self_attn.attn"])
    with pytest.raises(RuntimeError, match=r"stage 1 holds attention layers 0-1, .* gives it 1-1"):
        parallel.check_stage_layers(topo, ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"])


def test_a_ray_worker_without_the_metrics_folder_warns(monkeypatch, caplog):
    vc = fake_vllm_config({})
    vc.parallel_config = SimpleNamespace(distributed_executor_backend="ray")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with caplog.at_level("WARNING", logger="elastic_vllm.vllm_plugin"):
        parallel.warn_if_metrics_stay_here(vc)
    assert "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PROMETHEUS_MULTIPROC_DIR" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp")
    parallel.warn_if_metrics_stay_here(vc)
    vc.parallel_config = SimpleNamespace(distributed_executor_backend="mp")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    parallel.warn_if_metrics_stay_here(vc)
    assert caplog.text == ""
