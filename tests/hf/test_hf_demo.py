"""The real demo model (SmolLM2-135M-Instruct) through the elastic transformers path."""

import pytest
import torch
from testlib import assert_needle_answered

from elastic_vllm.hf import load_elastic_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def elastic_demo(demo_model_dir, one_thread):
    return load_elastic_model(demo_model_dir, {"force": "all-FA", "sink": 128, "window": 512})


def test_needle_answered_through_elastic_path_all_fa(elastic_demo):
    model, tok = elastic_demo
    model.elastic_state.num_prefills = 0
    assert model.config._attn_implementation == "elastic"
    assert_needle_answered(model, tok)
    state = model.elastic_state
    assert state.num_prefills == 1 and state.last_routing.shape == (1, 30, 3) and state.last_routing.all()


def test_demo_model_all_sa_differs_only_past_the_window(elastic_demo):
    """With every head SSA, tokens inside sink + window see exactly what FA sees."""
    model, tok = elastic_demo
    state = model.elastic_state
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. " * 12)])[:, :100]
    state.set_config(force="all-FA", sink=4, window=64)
    fa = model(input_ids=ids).logits
    state.set_config(force="all-SA")
    sa = model(input_ids=ids).logits
    state.set_config(force="all-FA", sink=128, window=512)
    torch.testing.assert_close(sa[:, :64], fa[:, :64], atol=1e-4, rtol=1e-4)
    assert (sa[:, 70:] - fa[:, 70:]).abs().max() > 1e-2
