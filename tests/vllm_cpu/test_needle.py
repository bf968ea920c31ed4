"""A 2K-token needle-in-a-haystack prompt through the elastic vLLM backend (SmolLM2, chunked prefill off:
the paper's once-per-request routing over the whole prompt; sink 128 / window 512, SA heads sparse at
decode too).

With the router that keeps the retrieval heads FA the needle is found; with every head SA it is not,
already at 1.2K tokens (the needle sits ~600 tokens back, past the 512-token window: the sparse path
really runs). ``retrieval_router`` is constructed from the measured retrieval heads (known decisions);
the shipped trained router's needle accuracy is measured by scripts/measure_trained_router.py.
"""

from __future__ import annotations

import pytest

from elastic_vllm.eval.needle import make_needle_prompt
from elastic_vllm.vllm_plugin import observe

from .conftest import close_llm, make_llm
from .helpers import event_of, greedy
from .routers import SMOLLM2_RETRIEVAL_HEADS

pytestmark = pytest.mark.slow

CFG = {"sink": 128, "window": 512, "decode_mode": "sparse"}


def test_needle_2k_router_keeps_retrieval_heads(demo_model_dir, retrieval_router):
    llm = make_llm(
        demo_model_dir,
        attention_backend="elastic",
        additional_config={"elastic": {**CFG, "router_path": str(retrieval_router)}},
        enable_prefix_caching=False,  # each request computes its own prefill with its own routing
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
    )
    try:
        tok = llm.get_tokenizer()
        needle = make_needle_prompt(tok, 2000, depth=0.5, seed=0)
        short = make_needle_prompt(tok, 1200, depth=0.5, seed=0)
        auto, all_sa = llm.generate(
            [needle.text(tok), short.text(tok)], [greedy(10), greedy(10, force="all-SA")], use_tqdm=False
        )
    finally:
        close_llm(llm)
    assert 1800 <= len(auto.prompt_token_ids) <= 2100
    assert needle.answer in auto.outputs[0].text, auto.outputs[0].text
    assert short.answer not in all_sa.outputs[0].text, all_sa.outputs[0].text
    e = event_of(auto.request_id)
    assert 0.0 < e.omega_msr < 1.0 and 0.0 < e.omega_esr < e.omega_msr
    assert {tuple(x) for x in e.decisions.nonzero().tolist()} == set(SMOLLM2_RETRIEVAL_HEADS)
    assert event_of(all_sa.request_id).omega_msr == 1.0
    assert observe.COUNTERS.final_routings >= 2
