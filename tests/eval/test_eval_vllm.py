"""vLLM (CPU build, elastic backend) and transformers agree on the harness's prompts: same routing, same tokens."""

import pytest

from elastic_vllm.config import ElasticConfig
from elastic_vllm.eval.agreement import vllm_agreement
from elastic_vllm.eval.needle import make_needle_prompt
from elastic_vllm.hf.testing import sharp_router
from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, save_router

pytestmark = pytest.mark.slow  # a real vLLM engine on the demo model


def test_vllm_and_transformers_agree(demo_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    router = sharp_router(30, 64, seed=3)  # sharp logits: a mix of FA and SA heads
    meta = RouterMeta(backbone=BackboneMeta(num_layers=30, num_kv_heads=3, head_dim=64, id="smollm2-test"))
    save_router(router, tmp_path / "router", meta)
    records = []
    for i in range(2):
        p = make_needle_prompt(tok, 400 + 150 * i, depth=0.4, seed=i)
        records.append({"task": "niah", "length": 512, "index": i, "input": p.text(tok)})
    # window 128 < prompt length: SA heads really are sparse
    res = vllm_agreement(demo_model_dir, tmp_path / "router", records, ElasticConfig(sink=32, window=128), 8)
    s = res["summary"]
    assert s["n"] == 2 and s["vllm_forward_calls"] > 0  # the elastic backend ran
    for row in res["prompts"]:
        assert row["routing_found"] and row["routing_equal"], row
        assert 0 < row["omega_msr_hf"] < 1  # a real mix of FA and SA heads
        assert row["common_prefix"] >= 4, row  # greedy float32 decoding of both engines
