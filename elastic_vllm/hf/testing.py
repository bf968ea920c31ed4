"""Tiny random decoders (Llama, Qwen2, Qwen3) with a byte-level tokenizer and a chat template.

For tests and smoke runs of the integration and the trainer: no download, seconds on a CPU.
``save_tiny_model(family, folder)`` writes a folder that ``from_pretrained`` and the
``train-router`` CLI load like a real model; ``sharp_router`` gives them a router that mixes FA and SA heads.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sharp_router(layers: int = 3, head_dim: int = 16, seed: int = 0, gain: float = 30.0):
    """A random ElasticRouter (torch seed ``seed``) whose decision logits are scaled by ``gain``: they move a lot with
    the input, so decisions differ between prompts and heads (at gain 1 a random router's logits sit near 0)."""
    from elastic_vllm.router.model import ElasticRouter

    torch.manual_seed(seed)
    r = ElasticRouter(layers, head_dim)
    with torch.no_grad():
        for layer in r.layers:
            layer.cls_router_head_agnostic[4].weight.mul_(gain)
    return r


def tiny_config(family: str = "llama", layers: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=260,
        hidden_size=heads * head_dim,
        intermediate_size=4 * heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        eos_token_id=257,
        pad_token_id=258,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    if family == "llama":
        return LlamaConfig(head_dim=head_dim, **common)
    if family == "qwen2":  # q/k/v projections with bias
        return Qwen2Config(**common)
    if family == "qwen3":  # q_norm / k_norm: the router must read keys AFTER k_norm
        return Qwen3Config(head_dim=head_dim, **common)
    raise ValueError(f"unknown family {family!r} (expected one of {FAMILIES})")


def tiny_model(family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **shape):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **shape)
    cfg._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    with torch.no_grad():  # larger weights than the default init, so attention patterns matter
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


def byte_tokenizer():
    """One token per byte (GPT-2 byte alphabet) + <|im_start|> 256, <|im_end|> 257 (eos), pad 258."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for s in ("<|im_start|>", "<|im_end|>", "<|pad|>"):
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|pad|>", additional_special_tokens=["<|im_start|>"]
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_model(family: str, folder: str | Path, seed: int = 0, **shape) -> Path:
    out = Path(folder)
    tiny_model(family, seed, **shape).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out
