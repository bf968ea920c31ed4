"""The transformers engine's Triton path (elastic_vllm.csrc kernels; TRITON_INTERPRET=1 on the CPU)
equals its torch path: padded batch, FA / SSA / XA heads, prefill and decode."""

import pytest
import torch

from elastic_vllm.hf import enable_elastic, triton_backend
from elastic_vllm.hf.testing import tiny_model
from elastic_vllm.router.model import ElasticRouter

pytestmark = pytest.mark.skipif(not triton_backend.available(), reason="triton / elastic_vllm.csrc not importable")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models: one thread is several times faster than two on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_auto_picks_torch_on_cpu():
    assert enable_elastic(tiny_model("llama"), {"force": "all-FA"}, impl="auto").impl == "torch"


def test_triton_path_matches_torch_path_padded_fa_xa_with_decode():
    torch.manual_seed(1)
    router = ElasticRouter(3, 16)
    with torch.no_grad():
        for layer in router.layers:
            layer.cls_router_head_agnostic[4].weight.mul_(30.0)
    model = tiny_model("llama")
    state = enable_elastic(
        model, {"mode": "FA-XA", "sink": 4, "window": 12, "xattn_block": 16, "xattn_stride": 4}, router
    )
    ids = torch.randint(0, 256, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :13] = 0  # left padding: per-row launches over views of the real tokens
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    kw.update(output_scores=True, return_dict_in_generate=True)
    ref = model.generate(**kw)
    routing = state.last_routing.clone()
    assert 0 < routing.sum() < routing.numel()
    state.impl = "triton"
    got = model.generate(**kw)
    assert torch.equal(state.last_routing, routing)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
