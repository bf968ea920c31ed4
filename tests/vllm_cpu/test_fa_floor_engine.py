"""The fail-safe floor (``fa_floor``) in the vLLM backend: the engine state's floor mask per tensor-parallel rank
and its routing through the policy (no engine), then a real CPU engine serving the demo model with the shipped
router and its stored ranking (slow): the floor heads are FA in the recorded routing, Omega_MSR drops by exactly
the floor heads the router sent to SA, a force overrides the floor and a budget stays exact."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from elastic_vllm.config import ConfigError
from elastic_vllm.reference.rope import RopeSpec
from elastic_vllm.router.checkpoint import RetrievalRanking, add_ranking, load_router
from elastic_vllm.router.model import ElasticRouter, budget_sa_counts, decide
from elastic_vllm.router.policy import floor_mask, route_heads
from elastic_vllm.vllm_plugin import compat, observe
from elastic_vllm.vllm_plugin.state import EngineState

from .routers import save_test_router
from .test_units import BS, HKV, Cached, L, NewReq, PagedSim, SchedOut, _RankSim, fake_vllm_config, run_step


def _ranked_router(tmp_path, scores):
    torch.manual_seed(3)
    path = save_test_router(ElasticRouter(L, 64), tmp_path / "r", HKV)
    return add_ranking(path, RetrievalRanking(scores=scores))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_state_floor_per_tensor_parallel_rank(tmp_path, monkeypatch, tp):
    """Each rank keeps the floor columns of its own KV heads (replicas when tp > KV heads) of the model-wide mask,
    and routes its heads through the policy with them."""
    scores = [[0.9, 0.1], [0.2, 0.8]]  # L = 2 layers x HKV = 2 heads; floor 2: (0, 0) and (1, 1)
    path = _ranked_router(tmp_path, scores)
    whole = floor_mask(torch.tensor(scores), 2)
    lens = {"A": 300, "B": 40}
    sim = PagedSim(lens, RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config), seed=5)
    cfg = {"elastic": {"router_path": str(path), "pool_tokens": 8, "sink": 4, "fa_floor": 2}}
    observe.clear()

    states = []
    for r in range(tp):  # built one after the other: each reads its rank from compat at construction
        monkeypatch.setattr(compat, "tp_rank_and_size", lambda r=r: (r, tp))
        vc = fake_vllm_config(cfg)
        vc.model_config.get_num_kv_heads = lambda pc: max(1, HKV // tp)
        st = EngineState(vc)
        st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
        heads = list(st.kv_heads)
        assert torch.equal(st.floor.bool(), whole[:, heads]) and st.has_floor == bool(whole[:, heads].any())
        states.append(st)

    def step(st):
        so = SchedOut([NewReq("A", [0] * 300), NewReq("B", [0] * 40)], Cached(), {"A": 300, "B": 40})
        run_step(st, _RankSim(sim, list(st.kv_heads)), so, ["A", "B"], [300, 40], [300, 40])

    if tp > 1:  # the ranks' tensor-parallel gather needs them all at once
        gathered: list = []
        barrier = threading.Barrier(tp, timeout=60)

        def all_gather(obj):
            gathered.append(obj)
            barrier.wait()
            out = list(gathered)
            barrier.wait()
            return out

        monkeypatch.setattr(compat, "tp_all_gather_object", all_gather)
    with ThreadPoolExecutor(tp) as pool:
        for f in [pool.submit(step, st) for st in states]:
            f.result()
    for e in observe.events():
        heads = list(e.kv_heads)
        fl = whole[:, heads]
        assert e.decisions[fl].all()  # the floor heads run FA
        for layer in range(L):
            assert torch.equal(e.decisions[layer], decide(e.logits[layer]) | fl[layer])
    assert len(observe.events()) == 2 * tp
    assert sorted({h for st in states for h in st.kv_heads}) == list(range(HKV))  # every head on some rank


def test_engine_refuses_a_floor_without_a_ranking(tmp_path):
    path = save_test_router(ElasticRouter(L, 64), tmp_path / "r", HKV)
    with pytest.raises(ConfigError, match=rf"elastic\.fa_floor 1 needs the retrieval-head ranking.*router-rank {path}"):
        EngineState(fake_vllm_config({"elastic": {"router_path": str(path), "fa_floor": 1}}))


# --- a real engine: the demo model and the shipped router ------------------------------------------------------
HEADS = 30 * 3
FLOOR = 9
SHIPPED = Path(__file__).resolve().parents[2] / "router_weights" / "smollm2-135m-instruct"
ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=8, block_size=32, max_model_len=2048)


def document(tag: str) -> str:
    # ~500 tokens, far past sink + window (40), in the shipped router's "docs -> SA" regime
    return " ".join(f"[{tag}] Line {j}: the archive lists {j * 17 % 97} maps of the {tag} coast." for j in range(40))


@pytest.mark.slow
def test_real_engine_keeps_the_floor_heads_fa(demo_model_dir):
    from .conftest import close_llm, make_llm
    from .helpers import event_of, greedy

    shipped = load_router(SHIPPED)
    assert shipped.router.retrieval_scores is not None, "the shipped router must carry its retrieval ranking"
    floor = floor_mask(shipped.router.retrieval_scores, FLOOR)
    llm = make_llm(
        demo_model_dir, attention_backend="elastic",
        additional_config={"elastic": {"sink": 8, "window": 32, "fa_floor": FLOOR}}, **ENGINE,
    )  # fmt: skip
    try:
        text = document("floor")
        outs = llm.generate(
            [text, text, text],
            [greedy(4), greedy(4, xargs={"elastic_force": "all-SA"}), greedy(4, xargs={"elastic_target_omega": 0.9})],
            use_tqdm=False,
        )
        auto, forced, budget = (event_of(o.request_id) for o in outs)
    finally:
        close_llm(llm)
    # auto: the router's decisions, the floor heads FA over them; Omega_MSR drops by the floor heads it sent SA
    plain = decide(auto.logits)
    assert torch.equal(auto.decisions, plain | floor) and auto.decisions[floor].all()
    moved = int((~plain & floor).sum())
    assert moved > 0, "the router should send some floor heads SA on this prompt, or the test shows nothing"
    # recorded in float32: 1e-6 is far below one head's 1 / 90
    assert auto.omega_msr_all == pytest.approx(((~plain).sum().item() - moved) / HEADS, abs=1e-6)
    # a force is explicit: every head SA, the floor's too
    assert not forced.decisions.any() and forced.omega_msr_all == 1.0
    # a budget: exact, the floor heads the last to go SA
    counts = budget_sa_counts(0.9, 30, 0, 1, 3)
    assert int((~budget.decisions).sum()) == sum(counts) == round(0.9 * HEADS)
    for layer in range(30):
        want = route_heads(budget.logits[layer : layer + 1], shipped_cfg(), budget=torch.tensor([counts[layer]]),
                           floor=floor[layer]).fa[0]  # fmt: skip
        assert torch.equal(budget.decisions[layer], want), layer


def shipped_cfg():
    from elastic_vllm.config import ElasticConfig

    return ElasticConfig(sink=8, window=32, fa_floor=FLOOR)
