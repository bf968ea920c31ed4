"""Convert the authors' published routers (LCM-Lab/Elastic-Attention full-model checkpoints)
into this project's router format.

The authors store the routers inside the full model's safetensors (one file or shards with
``model.safetensors.index.json``)::

    model.layers.{i}.self_attn.mask_allocator.cls_feat_extractor.{0,2}.{weight,bias}
    model.layers.{i}.self_attn.mask_allocator.cls_router_head_agnostic.{0,2,4}.{weight,bias}

Other mask_allocator tensors (log_temp, attn_mask_log_alphas, sparsity_lambda*) are training
state and are ignored. Only the router tensors are read (safetensors, lazily); the backbone
weights are never loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elastic_vllm.router.checkpoint import (
    BackboneMeta,
    RouterCheckpointError,
    RouterMeta,
    RouterSpec,
    save_router,
)
from elastic_vllm.router.model import ElasticRouter

_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.mask_allocator\."
    r"(cls_feat_extractor\.[02]|cls_router_head_agnostic\.[024])\.(weight|bias)$"
)
AUTHOR_CONFIG_KEYS = (
    "toggle_type",
    "sink_size",
    "local_window_size",
    "pooling_mode",
    "use_softmax",
    "topk_k",
    "suggested_threshold",
    "block_size",
)


def _find_author_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    found = {k: cfg[k] for k in AUTHOR_CONFIG_KEYS if k in cfg}
    for v in cfg.values():
        if isinstance(v, dict):
            for k, x in _find_author_keys(v).items():
                found.setdefault(k, x)
    return found


def _attention_meta(author: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"authors_config": author}
    toggle = str(author.get("toggle_type", "")).lower()
    meta["mode"] = "FA-XA" if ("xattn" in toggle or "xattention" in toggle) else "FA-SSA"
    if "sink_size" in author:
        meta["sink"] = int(author["sink_size"])
    if "local_window_size" in author:
        meta["window"] = int(author["local_window_size"])
    if "suggested_threshold" in author:
        meta["xattn_threshold"] = float(author["suggested_threshold"])
    if "block_size" in author:
        meta["xattn_block"] = int(author["block_size"])
    return meta


def convert_authors_checkpoint(src: str | Path, out: str | Path, backbone_id: str | None = None) -> Path:
    """Read the routers out of an authors' model folder ``src`` and write ``out`` in our format."""
    src = Path(src)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise RouterCheckpointError(f"{src}: no config.json (expected the authors' full-model checkpoint folder)")
    cfg = json.loads(cfg_path.read_text())
    text_cfg = cfg.get("text_config", cfg)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise RouterCheckpointError(f"{src}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                m = _NAME.match(name)
                if m:
                    tensors[f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"] = st.get_tensor(name).float()
    if not tensors:
        raise RouterCheckpointError(
            f"{src}: no router tensors (model.layers.*.self_attn.mask_allocator.*) found in {len(files)} file(s)"
        )
    file_layers = sorted({int(k.split(".")[1]) for k in tensors})
    num_layers = int(text_cfg.get("num_hidden_layers", len(file_layers)))
    if num_layers != len(file_layers) or file_layers != list(range(num_layers)):  # before anything is sized by it
        raise RouterCheckpointError(
            f"{src}: config.json says num_hidden_layers={num_layers}, but the checkpoint holds router tensors for "
            f"{len(file_layers)} layers (indices {file_layers[0]}..{file_layers[-1]}); a router is needed in every layer"
        )
    head_dim = tensors["layers.0.cls_feat_extractor.0.weight"].shape[1]
    hidden = tensors["layers.0.cls_feat_extractor.0.weight"].shape[0]
    if hidden % head_dim:
        raise RouterCheckpointError(f"{src}: Task MLP hidden size {hidden} is not a multiple of head_dim {head_dim}")
    router = ElasticRouter(num_layers, head_dim, hidden // head_dim)
    expected = set(router.state_dict())
    missing = sorted(expected - set(tensors))
    if missing:
        raise RouterCheckpointError(f"{src}: router tensors missing for {len(missing)} names, e.g. {missing[:3]}")
    router.load_state_dict(tensors)
    heads = int(text_cfg.get("num_attention_heads", 0))
    kv = int(text_cfg.get("num_key_value_heads", heads))
    author = _find_author_keys(cfg)
    meta = RouterMeta(
        backbone=BackboneMeta(
            id=backbone_id or cfg.get("_name_or_path") or src.name,
            model_type=text_cfg.get("model_type", "unknown"),
            num_layers=num_layers,
            num_kv_heads=kv,
            head_dim=head_dim,
        ),
        router=RouterSpec(hidden_mult=hidden // head_dim),
        pooling={"mode": "boundary", "tokens": 100, "authors_pooling_mode": author.get("pooling_mode")},
        attention=_attention_meta(author),
        training={"source": f"converted from the authors' checkpoint {src.name}"},
    )
    return save_router(router, out, meta)
