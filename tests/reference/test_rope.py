import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from elastic_vllm.reference.rope import RopeSpec, apply_rope, invert_rope


def _cfg(**rope):
    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_parameters=rope)


def _check(cfg):
    spec = RopeSpec.from_hf_config(cfg)
    T, H, D = 50, 2, 64
    x = torch.randn(T, H, D)
    pos = torch.randint(0, 100_000, (T,))
    emb = LlamaRotaryEmbedding(cfg)
    cos, sin = emb(x, pos[None])
    _, want = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    got = apply_rope(x, pos, spec)
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(invert_rope(got, pos, spec), x, atol=2e-4, rtol=1e-4)


def test_default_rope_matches_transformers():
    _check(_cfg(rope_type="default", rope_theta=100000.0))


def test_llama3_scaled_rope_matches_transformers():
    _check(
        _cfg(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
    )
