"""Transformers reference for the router's input: pre-RoPE keys from forward hooks, pooled and routed.

Llama: the output of ``self_attn.k_proj``; Qwen3: the output of ``self_attn.k_norm`` (k_norm comes
before RoPE). Same pooling (``router.model.pool_keys``) and router as the vLLM backend.
"""

from __future__ import annotations

import torch

from elastic_vllm.router.model import ElasticRouter, pool_keys


class HFReference:
    def __init__(self, model_dir, dtype=torch.float32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        self.cfg = self.model.config

    def prerope_keys(self, ids: list[int]) -> list[torch.Tensor]:
        """Per layer [T, Hkv, D] pre-RoPE (post k_norm) keys of one prompt."""
        H = self.cfg.num_key_value_heads
        keys: dict[int, torch.Tensor] = {}
        hooks = []
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            mod = getattr(attn, "k_norm", None) or attn.k_proj

            def hook(_m, _inp, out, i=i):
                keys[i] = out[0].reshape(out.shape[1], H, -1).float()

            hooks.append(mod.register_forward_hook(hook))
        try:
            with torch.no_grad():
                self.model(torch.tensor([ids]))
        finally:
            for h in hooks:
                h.remove()
        return [keys[i] for i in range(len(keys))]

    def pooled(self, ids: list[int], pooling: str = "boundary", n: int = 100) -> torch.Tensor:
        """[L, Hkv, D] pooled pre-RoPE keys."""
        return torch.stack([pool_keys(k, pooling, n) for k in self.prerope_keys(ids)])

    @staticmethod
    def logits(router: ElasticRouter, pooled: torch.Tensor) -> torch.Tensor:
        """[L, Hkv, 2] router logits for pooled keys [L, Hkv, D]."""
        with torch.no_grad():
            return torch.stack([router(layer, pooled[layer]) for layer in range(pooled.shape[0])])


class HFElasticReference(HFReference):
    """The transformers elastic model (``elastic_vllm.hf``: attn_implementation="elastic", the project's
    reference engine): every layer routes from its own pre-RoPE keys during the prefill, with the
    hybrid attention of the layers below, as the vLLM backend does for an unchunked prompt."""

    def __init__(self, model_dir, cfg: dict, router_path=None, dtype=torch.float32):
        from elastic_vllm.hf import load_elastic_model

        self.model, self.tok = load_elastic_model(model_dir, cfg, router_path, dtype=dtype)
        self.cfg = self.model.config
        self.state = self.model.elastic_state

    def configure(self, router_path, **cfg) -> HFElasticReference:
        """Switch router and knobs (the model is shared by several tests)."""
        from elastic_vllm.config import ElasticConfig
        from elastic_vllm.router.checkpoint import load_router

        self.state.router = load_router(router_path).router if router_path is not None else None
        self.state.cfg = ElasticConfig.parse(cfg)
        return self

    def route(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [L, Hkv, 2], pooled pre-RoPE keys [L, Hkv, D]) of one prompt's prefill."""
        keys = self.prerope_keys(ids)
        pooled = torch.stack([pool_keys(k, self.state.cfg.pooling, self.state.cfg.pool_tokens) for k in keys])
        return self.state.last_logits[0].float().cpu(), pooled
