"""Static hybrid baseline: retrieval-score ranking on a tiny random model, and the routing it imposes."""

import pytest
import torch

from elastic_vllm.eval.baselines import calibration_prompts, retrieval_scores, static_routing
from elastic_vllm.hf import enable_elastic
from elastic_vllm.hf.testing import byte_tokenizer, tiny_model
from elastic_vllm.sparsity import omega_msr

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = " ".join(f"Sentence {i} tells of the {w} near the river." for i, w in enumerate(["oak", "fox", "sun"] * 40))


@pytest.fixture(scope="module")
def calib():
    return calibration_prompts(byte_tokenizer(), TEXT, lengths=(400,), per_length=2, seed=3)


def test_calibration_prompts_locate_the_needle(calib):
    assert len(calib) == 2
    for r in calib:
        a, b = r["needle_span"]
        assert r["input"][a:b] == r["outputs"][0] and r["outputs"][0].isdigit()
        assert r["task"] == "calib" and r["length"] == 400


def _eager_scores(model, tok, records) -> torch.Tensor:
    """Independent computation from transformers' eager attention probabilities."""
    cfg = model.config
    L, H, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    total = torch.zeros(L, Hkv, dtype=torch.float64)
    for r in records:
        enc = tok(r["input"], add_special_tokens=False, return_offsets_mapping=True)
        ans = tok.encode(" " + r["outputs"][0], add_special_tokens=False)
        ids = torch.tensor([enc["input_ids"] + ans])
        a, b = r["needle_span"]
        needle = torch.tensor([s < b and e > a for s, e in enc["offset_mapping"]] + [False] * len(ans))
        P = len(enc["input_ids"])
        with torch.no_grad():
            att = model(input_ids=ids, output_attentions=True).attentions  # L x [1, H, T, T]
        for layer, p in enumerate(att):
            m = p[0, :, P - 1 : P - 1 + len(ans)][:, :, needle].sum(-1).mean(-1)  # [H]
            total[layer] += m.view(Hkv, H // Hkv).mean(-1).double()
    return (total / len(records)).float()


def test_retrieval_scores_equal_eager_attention_mass(calib):
    tok = byte_tokenizer()
    model = tiny_model("llama", seed=1, attn_implementation="eager")
    ref = _eager_scores(model, tok, calib)
    ids = torch.tensor([tok.encode(calib[0]["input"], add_special_tokens=False)])
    before = model(input_ids=ids).logits
    got = retrieval_scores(model, tok, calib)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert got.shape == (3, 2) and bool((got > 0).all())
    # the recording attention computes ordinary dense attention, and the implementation is restored
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(model(input_ids=ids).logits, before)


def test_static_routing_realizes_the_requested_omega(calib):
    tok = byte_tokenizer()
    model = tiny_model("llama", seed=1)
    scores = retrieval_scores(model, tok, calib)
    state = enable_elastic(model, {"sink": 4, "window": 16})  # no router: only the imposed routing
    ids = torch.randint(0, 256, (2, 40))
    for omega in (0.0, 1 / 6, 0.5, 0.75, 1.0):
        routing = static_routing(scores, omega)
        n_sa = round(omega * scores.numel())
        assert omega_msr(routing) == pytest.approx(n_sa / scores.numel())
        if 0 < n_sa < scores.numel():  # the SA heads are exactly the lowest-scoring ones
            assert scores[~routing].max() <= scores[routing].min()
        # imposed on the elastic model: every request gets exactly this routing
        state.fixed_routing = routing
        model(input_ids=ids)
        assert torch.equal(state.last_routing.cpu(), routing.expand(2, -1, -1))
        assert state.omega_msr().tolist() == pytest.approx([n_sa / scores.numel()] * 2)


def test_static_routing_is_deterministic_on_ties():
    scores = torch.zeros(2, 3)
    r = static_routing(scores, 0.5)
    assert r.flatten().tolist() == [False, False, False, True, True, True]
    with pytest.raises(ValueError):
        static_routing(scores, 1.5)
