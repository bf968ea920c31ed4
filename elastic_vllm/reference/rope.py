"""RoPE, forward and inverse (NeoX / rotate-half style, as Llama, Qwen2 and Qwen3 use).

The router wants PRE-RoPE keys, but a paged KV cache holds POST-RoPE keys. RoPE is a
rotation, so the boundary keys are recovered exactly (up to the cache dtype's rounding) by
rotating back with the model's own frequencies::

    y = a * (x cos + rotate_half(x) sin)      =>      x = (y cos - rotate_half(y) sin) / a
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RopeSpec:
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    attention_scaling: float
    rotary_dim: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> RopeSpec:
        """The model's own RoPE frequencies, from its transformers config."""
        cfg = getattr(cfg, "text_config", None) or cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        if not params:  # transformers 4 style
            params = dict(getattr(cfg, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
        rotary_dim = int(head_dim * partial)
        if rope_type == "default":
            base = float(params["rope_theta"])
            # float32 exactly as transformers and vLLM compute it: at positions ~1e5 the angle's
            # float32 rounding depends on it, and the inversion must undo the same rotation
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
            return cls(inv_freq, 1.0, rotary_dim, head_dim)
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} changes with the sequence length; the router's pre-RoPE key "
                f"recovery supports {', '.join(_STATIC_ROPE_TYPES)}"
            )
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        return cls(inv_freq.float(), float(scaling), 2 * inv_freq.numel(), head_dim)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] (float32) for integer positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """x [T, H, D] pre-RoPE -> post-RoPE (float32)."""
    cos, sin = spec.cos_sin(positions)
    r = spec.rotary_dim
    xf = x.float()
    rot = xf[..., :r]
    rot = (rot * cos[:, None] + _rotate_half(rot) * sin[:, None]) * spec.attention_scaling
    return torch.cat([rot, xf[..., r:]], dim=-1)


def invert_rope(y: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """y [T, H, D] post-RoPE -> pre-RoPE (float32)."""
    cos, sin = spec.cos_sin(positions)
    r = spec.rotary_dim
    yf = y.float()
    rot = yf[..., :r]
    rot = (rot * cos[:, None] - _rotate_half(rot) * sin[:, None]) / spec.attention_scaling
    return torch.cat([rot, yf[..., r:]], dim=-1)
