"""Turn a transformers causal LM (Llama, Qwen2, Qwen3 families) into an Elastic Attention model.

    from elastic_vllm.hf import load_elastic_model
    model, tok = load_elastic_model(model_dir, ElasticConfig(window=512), router_path="router_weights/x")
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=32)
    model.elastic_state.last_routing   # bool [B, L, H_kv], True = FA-side head, per request
    model.elastic_state.last_logits    # float32 [B, L, H_kv, 2] router logits (index 1 = FA)

or, on a model you loaded yourself::

    elastic_vllm.hf.register()                       # makes attn_implementation="elastic" known
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="elastic")
    state = enable_elastic(model, cfg, router)       # hooks + state; switches the implementation too

Registration is explicit (nothing is patched at import). The router pools PRE-RoPE keys: a forward
hook on the attention module's ``k_norm`` (Qwen3) or ``k_proj`` (Llama, Qwen2) hands them to the
attention function; a forward pre-hook on the base model tells it whether this forward is a prefill
(no past keys) and which tokens are padding.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from elastic_vllm.config import ElasticConfig
from elastic_vllm.hf.attention import ATTN_IMPLEMENTATION, elastic_attention_forward
from elastic_vllm.hf.state import ElasticState
from elastic_vllm.router.checkpoint import BackboneShape, load_router
from elastic_vllm.router.model import ElasticRouter

IMPLS = ("torch", "reference", "triton", "auto")


def register() -> None:
    """Register ``attn_implementation="elastic"`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, elastic_attention_forward)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a decoder, in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "layer_idx")]
    return sorted(mods, key=lambda m: int(m.layer_idx))


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) else model


def _check_supported(model: torch.nn.Module, mods: list[torch.nn.Module], shape: BackboneShape) -> None:
    cfg = getattr(model.config, "text_config", None) or model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    ):
        raise ValueError("elastic attention needs a model whose layers all use full attention (no sliding window)")
    if len(mods) != shape.num_layers or [int(m.layer_idx) for m in mods] != list(range(shape.num_layers)):
        raise ValueError(
            f"found {len(mods)} attention modules with k_proj for a {shape.num_layers}-layer config; "
            "supported families: Llama, Qwen2, Qwen3"
        )


def enable_elastic(
    model: torch.nn.Module,
    cfg: ElasticConfig | dict | str | None = None,
    router: ElasticRouter | str | Path | None = None,
    impl: str = "torch",
) -> ElasticState:
    """Attach Elastic Attention to ``model`` (in place) and return its ``ElasticState``.

    router: an ElasticRouter, a router checkpoint folder, or None (then ``cfg.router_path`` if set;
    with no router at all only ``cfg.force`` in {"all-FA", "all-SA"} or ``state.fixed_routing`` route).
    cfg None with a checkpoint folder: the attention config the router was trained with.
    impl: "torch" (PyTorch, CPU and GPU), "triton" (``elastic_vllm.ops`` kernels, inference only),
    "reference" (the plain oracle of ``elastic_vllm.reference``, slow) or "auto" (triton on a CUDA
    model when the kernels import, else torch). Training always runs the torch (or reference) path.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        import elastic_vllm.hf.triton_backend as triton_backend

        on_gpu = next(model.parameters()).device.type == "cuda"
        impl = "triton" if on_gpu and triton_backend.available() else "torch"
    register()
    if cfg is None and isinstance(router, (str, Path)):
        cfg = config_of_router(router)  # the attention config the router was trained with
    cfg = ElasticConfig.parse(cfg)
    shape = BackboneShape.from_hf_config(model.config)
    mods = attention_modules(model)
    _check_supported(model, mods, shape)
    if getattr(model, "elastic_state", None) is not None:
        disable_elastic(model)
    if router is None and cfg.router_path:
        router = cfg.router_path
    if isinstance(router, (str, Path)):
        router = load_router(router, expect=shape, model_name=str(getattr(model.config, "_name_or_path", ""))).router
    if router is not None:
        if (router.num_layers, router.head_dim) != (shape.num_layers, shape.head_dim):
            raise ValueError(
                f"router has {router.num_layers} layers / head_dim {router.head_dim}, the model "
                f"{shape.num_layers} / {shape.head_dim}"
            )
        dev = next(model.parameters()).device
        router = router.to(device=dev, dtype=torch.float32)
    state = ElasticState(
        cfg=cfg,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        router=router,
        impl=impl,
    )
    for m in mods:
        m._elastic_state = state
        src = m.k_norm if isinstance(getattr(m, "k_norm", None), torch.nn.Module) else m.k_proj
        state.hooks.append(src.register_forward_hook(_key_hook(m, shape)))
    base = _base_model(model)
    state.hooks.append(base.register_forward_pre_hook(_forward_pre_hook(state, base), with_kwargs=True))
    set_attn_implementation(model, ATTN_IMPLEMENTATION)
    model.elastic_state = state
    return state


def set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    """Switch a transformers model's attention implementation (``set_attn_implementation``, or the configs)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
        return
    for m in model.modules():  # older transformers: the configs carry it
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def config_of_router(path: str | Path) -> ElasticConfig:
    """The ElasticConfig recorded in a router checkpoint's metadata (fields this build knows)."""
    from elastic_vllm.router.checkpoint import read_meta

    att = read_meta(path).attention
    return ElasticConfig.parse({k: v for k, v in att.items() if k in ElasticConfig.model_fields and k != "router_path"})


def disable_elastic(model: torch.nn.Module, attn_implementation: str = "sdpa") -> None:
    """Remove hooks and state; the model goes back to ``attn_implementation``."""
    state = getattr(model, "elastic_state", None)
    if state is None:
        return
    for h in state.hooks:
        h.remove()
    for m in attention_modules(model):
        for a in ("_elastic_state", "_elastic_keys"):
            if hasattr(m, a):
                delattr(m, a)
    model.elastic_state = None
    set_attn_implementation(model, attn_implementation)


def _key_hook(attn: torch.nn.Module, shape: BackboneShape):
    """Store the PRE-RoPE keys [B, T, Hkv, D] (k_norm output, else k_proj output) on the attention module."""

    def hook(_mod, _inp, out):
        attn._elastic_keys = out.reshape(out.shape[0], out.shape[1], shape.num_kv_heads, shape.head_dim)

    return hook


def _forward_pre_hook(state: ElasticState, base: torch.nn.Module):
    params = list(inspect.signature(base.forward).parameters)

    def hook(_mod, args, kwargs):
        got = dict(zip(params, args))
        got.update(kwargs)
        x = got.get("input_ids")
        if x is None:
            x = got.get("inputs_embeds")
        if x is None:
            raise ValueError("elastic attention needs input_ids or inputs_embeds")
        mask = got.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2:
                raise NotImplementedError("elastic attention takes a 2D padding mask (or none), not a 4D mask")
            mask = None if bool(mask.all()) else mask.bool()
        state.padding_mask = mask
        pkv = got.get("past_key_values")
        past = 0 if pkv is None else int(pkv.get_seq_length())
        state.in_prefill = past == 0
        if state.in_prefill:
            state.begin_prefill(x.shape[0], x.device)
        return None

    return hook


def load_elastic_model(
    model_dir: str | Path,
    cfg: ElasticConfig | dict | str | None = None,
    router_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    impl: str = "torch",
    **from_pretrained: Any,
):
    """Load tokenizer + model with ``attn_implementation="elastic"`` and attach the router. -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **from_pretrained
    )
    model.to(device).eval()
    enable_elastic(model, cfg, router_path, impl=impl)
    return model, tok
