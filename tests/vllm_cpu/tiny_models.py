"""Tiny random-weight Llama (head_dim 64) and Qwen3 (head_dim 128, q/k norm) checkpoints for engine
tests, saved with transformers (SmolLM2's tokenizer, so text prompts work)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "llama": dict(
        arch="LlamaForCausalLM",
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,
    ),
    "qwen3": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128,
    ),
}  # fmt: skip


def build_tiny_model(kind: str, out: Path, tokenizer_dir: Path, seed: int = 0, num_layers: int | None = None) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(TINY[kind])
    spec.pop("arch")
    if num_layers is not None:  # pipeline-parallel tests: 2 layers per stage
        spec["num_hidden_layers"] = num_layers
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    common = dict(
        vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**spec, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**spec, **common))
    with torch.no_grad():  # larger weights than the init's 0.02 make attention patterns (and outputs) peaked
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
