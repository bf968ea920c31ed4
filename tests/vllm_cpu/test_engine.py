"""The elastic backend in a real vLLM CPU engine (SmolLM2-135M-Instruct, float32, in this process).

Engine: chunked prefill with a 128-token budget (longer prompts arrive in chunks), prefix caching with
32-token blocks, SSA sink 8 / window 32 (so SA heads differ from FA on these short prompts), and a
router built to make known decisions (``routers.py``): the 10 retrieval heads FA, layer 29 head 0 FA
for prompt P1 and SA for P2, layer 0 a random router layer (small margins: decisions are compared with
the transformers reference up to LOGIT_EPS).

The transformers reference is ``elastic_vllm.hf`` (attn_implementation="elastic"): each layer routes
from pre-RoPE keys computed with the hybrid attention of the layers below, as vLLM does; it prefills a
prompt in one piece, so it is the reference for prompts that fit one vLLM chunk.
"""

from __future__ import annotations

import pytest
import torch

from elastic_vllm.router.model import LayerRouter
from elastic_vllm.vllm_plugin import observe

from .conftest import close_llm, make_llm, state_of
from .helpers import compare_decisions, event_of, greedy, top_logprobs
from .routers import (
    SMOLLM2_RETRIEVAL_HEADS,
    head_selecting_rules,
    linear_router,
    prompt_splitting_rule,
    save_test_router,
)

pytestmark = pytest.mark.slow

SPLIT_LAYER = 29
BUDGET = 128
ENGINE = dict(max_num_batched_tokens=BUDGET, max_num_seqs=16, block_size=32, max_model_len=2048)
ELASTIC = {"sink": 8, "window": 32}
# Plain-text prompts used only by the all-FA comparison (no block of theirs is cached by a routed request)
REF_PROMPTS = [
    "The three primary colors of light are",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn leaves:\n",
]
# Justified tolerance for all-FA vs CPU_ATTN (float32): the two backends sum attention in different orders
# (SDPA vs vLLM's C++ kernels); measured differences are ~1e-5 per logprob over 12 steps. 1e-3 is 100x that,
# and ~1000x below the gap between a greedy token and its runner-up that would flip a token.
LOGPROB_ATOL = 1e-3


def chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def prompts(hf_ref):
    tok = hf_ref.tok
    story = " ".join(f"Day {i}: the caravan crossed the dunes and counted {i * 7} camels." for i in range(1, 25))
    return {
        "P1": chat(tok, "Which planet is known as the red planet? Answer in one word."),
        "P2": chat(tok, "Translate to French: good morning, my friend."),
        "LONG": chat(tok, "Summarize this log in one sentence.\n" + story),
    }


@pytest.fixture(scope="module")
def split_router(tmp_path_factory, hf_ref, smollm2_pooled, prompts):
    """Retrieval heads FA, layer 0 random, layer 29 head 0 splitting P1 (FA) from P2 (SA). The split
    rule is fitted on the keys the elastic model computes at layer 29 (hybrid attention below it)."""
    rules = head_selecting_rules(smollm2_pooled, SMOLLM2_RETRIEVAL_HEADS)
    r = linear_router(30, 64, rules)
    torch.manual_seed(0)
    r.layers[0] = LayerRouter(64)
    d = tmp_path_factory.mktemp("router")
    base = save_test_router(r, d / "base", 3, "HuggingFaceTB/SmolLM2-135M-Instruct")
    hf_ref.configure(base, **ELASTIC)
    p1, p2 = (hf_ref.route(hf_ref.tok(prompts[k]).input_ids)[1] for k in ("P1", "P2"))
    rules[SPLIT_LAYER] = prompt_splitting_rule(p1[SPLIT_LAYER, 0], p2[SPLIT_LAYER, 0])
    r_split = linear_router(30, 64, rules)
    r_split.layers[0] = r.layers[0]
    return save_test_router(r_split, d / "split", 3, "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def llm(demo_model_dir, split_router):
    cfg = {"elastic": {**ELASTIC, "router_path": str(split_router)}}
    engine = make_llm(demo_model_dir, attention_backend="elastic", additional_config=cfg, **ENGINE)
    yield engine
    close_llm(engine)


@pytest.fixture
def hf_elastic(hf_ref, split_router):
    return hf_ref.configure(split_router, **ELASTIC)


@pytest.fixture(scope="module")
def cpu_llm(demo_model_dir, llm):
    engine = make_llm(demo_model_dir, attention_backend="CPU_ATTN", **ENGINE)
    yield engine
    close_llm(engine)


def test_elastic_forward_runs(llm, prompts):
    before = observe.COUNTERS.snapshot()
    out = llm.generate([prompts["P1"]], greedy(4), use_tqdm=False)[0]
    after = observe.COUNTERS.snapshot()
    steps = -(-len(out.prompt_token_ids) // BUDGET) + 3  # prefill chunks + decode steps
    assert after["forward_calls"] - before["forward_calls"] == 30 * steps
    assert after["final_routings"] == before["final_routings"] + 1
    assert len(out.outputs[0].token_ids) == 4


def test_batch_routings_recorded_independent_and_match_transformers(llm, hf_elastic, prompts):
    """One batch, two prompts: each gets its own routing, equal to the transformers elastic reference."""
    outs = llm.generate([prompts["P1"], prompts["P2"]], greedy(6), use_tqdm=False)
    e1, e2 = (event_of(o.request_id) for o in outs)
    assert e1.decisions[SPLIT_LAYER, 0] and not e2.decisions[SPLIT_LAYER, 0]
    assert not torch.equal(e1.decisions, e2.decisions)
    compared = 0
    for o, e in zip(outs, (e1, e2)):
        assert ELASTIC["window"] < e.prompt_len == len(o.prompt_token_ids) <= BUDGET  # SA differs from FA; one chunk
        assert e.force == "auto" and e.model_name
        compared += compare_decisions(e, hf_elastic.route(o.prompt_token_ids)[0])
        assert e.omega_msr == pytest.approx(float((~e.decisions).float().mean()))
        assert 0.0 < e.omega_esr <= e.omega_msr
    assert compared >= 0.9 * 2 * 90  # nearly every decision is far from a tie


def test_chunked_prefill_routes_every_chunk_on_its_prefix(llm, prompts):
    """chunk_routing="prefix": each chunk is routed over the prefix so far; the last chunk's routing is
    final, recorded once, and keeps the retrieval heads FA."""
    before = observe.COUNTERS.snapshot()
    out = llm.generate([prompts["LONG"]], greedy(3), use_tqdm=False)[0]
    after = observe.COUNTERS.snapshot()
    chunks = -(-len(out.prompt_token_ids) // BUDGET)
    assert chunks >= 3
    assert after["routed_rows"] - before["routed_rows"] == chunks
    assert after["final_routings"] - before["final_routings"] == 1
    e = event_of(out.request_id)
    assert e.prompt_len == len(out.prompt_token_ids)
    fa = {(layer, h) for layer, h in e.decisions.nonzero().tolist() if layer not in (0, SPLIT_LAYER)}
    assert fa == set(SMOLLM2_RETRIEVAL_HEADS)  # rules with wide margins: the same on a chunked prompt


def test_full_prefix_hit_routes_the_one_token_prefill(llm, hf_ref, prompts):
    """A repeated prompt of 4 x 32 + 1 tokens: the second request finds 128 tokens cached and prefills one
    token; it is routed at that step, from the cached boundary keys, exactly like the first request."""
    ids = hf_ref.tok(prompts["LONG"].replace("Summarize", "Condense")).input_ids[: 4 * 32 + 1]  # 2 chunks
    first = llm.generate([{"prompt_token_ids": ids}], greedy(2), use_tqdm=False)[0]
    before = observe.COUNTERS.snapshot()
    second = llm.generate([{"prompt_token_ids": ids}], greedy(2), use_tqdm=False)[0]
    after = observe.COUNTERS.snapshot()
    assert second.num_cached_tokens == 128
    assert after["routed_rows"] - before["routed_rows"] == 1
    e1, e2 = event_of(first.request_id), event_of(second.request_id)
    assert torch.equal(e1.decisions, e2.decisions)
    torch.testing.assert_close(e1.logits, e2.logits, atol=1e-5, rtol=0)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_mixed_prefill_and_decode_batch(llm, prompts):
    """A request decoding while another prefills in the same steps: both as when run alone."""
    solo_a = llm.generate([prompts["P1"]], greedy(10), use_tqdm=False)[0]
    b_text = prompts["P2"].replace("French", "Italian")
    solo_b = llm.generate([b_text], greedy(3), use_tqdm=False)[0]
    eng = llm.llm_engine
    before = observe.COUNTERS.snapshot()
    eng.add_request("mix-a", prompts["P1"], greedy(10))
    for _ in range(3):
        eng.step()
    eng.add_request("mix-b", b_text, greedy(3))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert observe.COUNTERS.mixed_steps > before["mixed_steps"]
    assert done["mix-a"].outputs[0].token_ids == solo_a.outputs[0].token_ids
    assert done["mix-b"].outputs[0].token_ids == solo_b.outputs[0].token_ids
    assert torch.equal(event_of("mix-b").decisions, event_of(solo_b.request_id).decisions)


def test_abort_frees_request_state(llm, prompts):
    state = state_of(llm)
    eng = llm.llm_engine
    eng.add_request("abort-a", prompts["P2"], greedy(64))
    eng.add_request("abort-b", prompts["P1"], greedy(8))
    for _ in range(3):
        eng.step()
    live = state.live_request_ids()
    assert any(r.startswith("abort-a") for r in live) and any(r.startswith("abort-b") for r in live)
    eng.abort_request(["abort-a"])
    eng.step()
    assert not any(r.startswith("abort-a") for r in state.live_request_ids())
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("abort-c", prompts["P1"], greedy(1))  # a step that carries b's finish
    while eng.has_unfinished_requests():
        eng.step()
    assert not any(r.startswith(("abort-a", "abort-b")) for r in state.live_request_ids())
    assert state.requests.free_slots and len(state.requests.free_slots) >= state.num_slots - 2


def test_per_request_override(llm, prompts):
    p = prompts["P2"].replace("good morning", "good night")
    fa, sa = llm.generate([p, p], [greedy(2, force="all-FA"), greedy(2, force="all-SA")], use_tqdm=False)
    e_fa, e_sa = event_of(fa.request_id), event_of(sa.request_id)
    assert e_fa.decisions.all() and e_fa.omega_msr == 0.0 and e_fa.force == e_fa.override == "all-FA"
    assert not e_sa.decisions.any() and e_sa.omega_msr == 1.0 and e_sa.force == "all-SA"
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"vllm_xargs.elastic_force: must be one of"):
        llm.generate([p], greedy(2, force="fast"), use_tqdm=False)


def test_all_fa_matches_cpu_attn_and_other_backend_is_untouched(llm, cpu_llm):
    """Every head forced FA equals vLLM's own CPU backend; with CPU_ATTN selected our code never runs."""
    ours = llm.generate(REF_PROMPTS, greedy(12, logprobs=1, force="all-FA"), use_tqdm=False)
    before = observe.COUNTERS.snapshot()
    theirs = cpu_llm.generate(REF_PROMPTS, greedy(12, logprobs=1), use_tqdm=False)
    assert observe.COUNTERS.snapshot() == before  # no elastic forward, routing or recording
    worst = 0.0
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = (torch.tensor(top_logprobs(a)) - torch.tensor(top_logprobs(b))).abs().max().item()
        worst = max(worst, diff)
    assert worst <= LOGPROB_ATOL, worst
