"""benchmarks/router_input_probe.py: its boundary pooling is the router's (router.model.pool_keys), the captured
keys are the pre-RoPE k_proj outputs, the AUC and the leave-one-haystack-out probe against known answers, and the
reworded summaries replace exactly the suite's instruction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import router_input_probe as P  # noqa: E402

from elastic_vllm.eval import heldout as H  # noqa: E402
from elastic_vllm.router.model import pool_keys  # noqa: E402


@pytest.mark.parametrize("T", [150, 199, 201, 230, 1200])
def test_boundary_pooling_is_the_routers_and_tail_mixes_the_last_tokens(T):
    g = torch.Generator().manual_seed(T)
    keys = torch.randn(T, 3, 2, 8, generator=g)  # [T, L, H, d]
    got = P.pool(keys, ("boundary", 0, 0.0))
    for layer in range(3):
        torch.testing.assert_close(got[layer], pool_keys(keys[:, layer], "boundary", P.N_BOUNDARY))
    tail = P.pool(keys, ("tail16-a0.5", 16, 0.5))
    want = 0.5 * got + 0.5 * keys[T - 16 :].mean(0)
    torch.testing.assert_close(tail, want)
    assert not torch.allclose(tail, got, atol=1e-3)


def test_captured_keys_are_pre_rope_k_proj_outputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids = list(range(3, 20))
    keys = P.capture_keys(model, ids)
    assert keys.shape == (len(ids), 2, 2, 8)
    with torch.no_grad():
        h = model.model.embed_tokens(torch.tensor([ids]))
        layer0 = model.model.layers[0]
        want = layer0.self_attn.k_proj(layer0.input_layernorm(h))[0].view(len(ids), 2, 8)
    torch.testing.assert_close(keys[:, 0], want)
    assert not torch.allclose(keys[:, 1], want, atol=1e-3)


def test_auc_against_known_orders():
    assert P.auc([3, 2, 1, 0], [1, 1, 0, 0]) == 1.0
    assert P.auc([0, 1, 2, 3], [1, 1, 0, 0]) == 0.0
    assert P.auc([1, 1, 1, 1], [1, 0, 1, 0]) == 0.5
    assert P.auc([2, 0, 1], [1, 0, 1]) == 1.0
    assert P.auc([0.3, 0.1, 0.2, 0.4], [1, 0, 0, 1]) == 1.0 and P.auc([0.2, 0.3, 0.1], [1, 0, 0]) == 0.5


def test_held_out_probe_finds_a_task_signal_and_not_noise():
    g = torch.Generator().manual_seed(0)
    n, groups = 120, [f"h{i % 6}" for i in range(120)]
    labels = [(i // 6) % 2 for i in range(n)]  # every haystack holds both tasks
    y = torch.tensor(labels, dtype=torch.float32)
    hay = torch.tensor([int(x[1]) for x in groups], dtype=torch.float32)
    noise = torch.randn(n, 16, generator=g)
    signal = noise.clone()
    signal[:, 0] += 4 * y  # the task in one direction (AUC 0.998 for a known direction)
    signal[:, 1] += 5 * hay  # the haystack in another, larger
    mean, per = P.held_out_auc(signal, labels, groups)
    assert len(per) == 6 and mean > 0.9
    mean_noise, _ = P.held_out_auc(noise, labels, groups)
    assert 0.3 < mean_noise < 0.7
    # scored on other rows: the held-out fold's rows with the task direction removed score near chance
    blind = signal.clone()
    blind[:, 0] = noise[:, 0]
    mean_blind, _ = P.held_out_auc(signal, labels, groups, blind)
    assert mean_blind < 0.75


def test_reworded_summaries_replace_the_suites_instruction():
    from transformers import AutoTokenizer

    from elastic_vllm.models import fetch_demo_model

    tok = AutoTokenizer.from_pretrained(fetch_demo_model())
    pr = H.make_prompt("summarize", "logs", "after", 4, tok, 300)
    assert pr.question and pr.question in pr.content
    new = P.reworded(pr.content, pr.question, pr.index)
    assert pr.question not in new and new.endswith(P.REWORDED[4 % 3].format(what="system log"))
    assert new.removesuffix(P.REWORDED[1].format(what="system log")) == pr.content.removesuffix(pr.question)
    with pytest.raises(ValueError, match="not a summary instruction"):
        P.reworded(pr.content, "What is the number?", 0)
