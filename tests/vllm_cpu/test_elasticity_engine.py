"""Per-request elasticity knobs (``elastic_target_omega``, ``elastic_bias``) on a real CPU vLLM engine with the
shipped SmolLM2 router (30 layers x 3 KV heads): exact budgets next to an unchanged default request, the
recorded metrics, and prefix-cache isolation between knob values (prefix caching on, vLLM's default)."""

from __future__ import annotations

import pytest
import torch

from elastic_vllm.router.model import decide, effective_margin

from .conftest import close_llm, make_llm, state_of
from .helpers import event_of, greedy

pytestmark = pytest.mark.slow

HEADS = 30 * 3
ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=8, block_size=32, max_model_len=2048)


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    # fa_floor 0: the knobs are checked against the router's own decision (the floor: test_fa_floor_engine.py)
    cfg = {"sink": 8, "window": 32, "fa_floor": 0}
    engine = make_llm(demo_model_dir, attention_backend="elastic", additional_config={"elastic": cfg}, **ENGINE)
    yield engine
    close_llm(engine)


def document(tag: str) -> str:
    # ~500 tokens, far past sink + window (40): SA heads see a small part of it, so the routing changes the K/V
    return " ".join(f"[{tag}] Line {j}: the archive lists {j * 17 % 97} maps of the {tag} coast." for j in range(40))


def sample(name: str, llm) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"model_name": state_of(llm).model_name})


def test_target_omega_is_exact_and_the_default_request_beside_it_is_unchanged(llm):
    plain, other = document("plain"), document("budget")
    alone = llm.generate([plain], greedy(6), use_tqdm=False)[0]
    e_alone = event_of(alone.request_id)
    before = {n: sample(n, llm) or 0.0 for n in ("elastic:requested_target_omega_sum", "elastic:request_omega_msr_sum")}
    outs = llm.generate([other, plain], [greedy(6, xargs={"elastic_target_omega": 0.5}), greedy(6)], use_tqdm=False)
    tgt, dflt = event_of(outs[0].request_id), event_of(outs[1].request_id)
    # Omega_MSR == round(0.5 x L x H) / (L x H), exactly, whatever the router prefers
    assert tgt.omega_msr_all == round(0.5 * HEADS) / HEADS == 0.5
    assert int((~tgt.decisions).sum()) == 45 and tgt.force == "target-omega"
    assert sample("elastic:requested_target_omega_sum", llm) - before["elastic:requested_target_omega_sum"] == 0.5
    omega_sum = sample("elastic:request_omega_msr_sum", llm) - before["elastic:request_omega_msr_sum"]
    assert omega_sum == pytest.approx(0.5 + dflt.omega_msr_all)  # /metrics records both requests' Omega
    # the default request beside it: the router's own argmax, the same routing and answer as when it ran alone
    assert dflt.force == "auto" and dflt.bias == 0.0 and dflt.target_omega is None
    assert torch.equal(dflt.decisions, decide(dflt.logits))
    assert torch.equal(dflt.decisions, e_alone.decisions) and outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert 0.0 < e_alone.omega_msr_all != 0.5  # the router alone picks another share: the budget is what made 0.5


def test_bias_moves_every_head_against_the_reference(llm):
    text = document("bias")
    seen = []
    for bias in (-1024.0, 0.0, 1024.0):
        out = llm.generate([text], greedy(2, xargs={"elastic_bias": bias}), use_tqdm=False)[0]
        e = event_of(out.request_id)
        assert e.force == "bias" and e.requested_bias == bias
        assert torch.equal(e.decisions, decide(e.logits, effective_margin(0.0, bias)))
        seen.append(e.omega_msr_all)
    # 1024 is past every margin of the shipped router (-737 .. +141): all FA, then all SA
    assert seen[0] == 0.0 and seen[2] == 1.0 and seen[0] <= seen[1] <= seen[2]


def test_prefix_cache_isolates_knob_values(llm):
    text = document("isolation")

    def run(xargs):
        out = llm.generate([text], greedy(8, xargs=xargs), use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first_hits, cold = run({"elastic_target_omega": 0.25})
    assert first_hits == 0
    same_hits, same = run({"elastic_target_omega": 0.25})  # the same knob value shares its blocks
    assert same_hits >= 32 * 10 and same == cold
    assert run({"elastic_target_omega": 0.75})[0] == 0  # another value never reuses them
    assert run({"elastic_bias": 1.0})[0] == 0
    assert run({"elastic_bias": 2.0})[0] == 0
    assert run({"elastic_bias": 1.0})[0] >= 32 * 10
    assert run(None)[0] == 0  # nor does a default request


@pytest.mark.parametrize(
    "xargs, msg",
    [
        ({"elastic_target_omega": 2}, r"vllm_xargs.elastic_target_omega: must be in \[0, 1\] \(got 2\)"),
        ({"elastic_target_omega": True}, r"vllm_xargs.elastic_target_omega: must be a number"),
        ({"elastic_bias": float("nan")}, r"vllm_xargs.elastic_bias: must be a finite number"),
        ({"elastic_bias": 1.0, "elastic_force": "all-SA"}, r"elastic_bias: cannot be combined with elastic_force"),
    ],
)
def test_offline_admission_refuses_bad_knobs_naming_the_field(llm, xargs, msg):
    """Offline (``SamplingParams.extra_args``) the same check runs before the engine sees the request."""
    from vllm.exceptions import VLLMValidationError

    before = len(state_of(llm).live_request_ids())
    with pytest.raises(VLLMValidationError, match=msg):
        llm.generate([document("refused")], greedy(2, xargs=xargs), use_tqdm=False)
    assert len(state_of(llm).live_request_ids()) == before  # nothing reached the engine
