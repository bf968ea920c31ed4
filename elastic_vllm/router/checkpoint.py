"""Router checkpoint format: ``router.safetensors`` + ``router.json``, one folder per backbone.

router.json::

    {"format": "elastic-vllm-router", "format_version": 1,
     "backbone": {"id": ..., "model_type": "llama", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
     "router":   {"hidden_mult": 4},
     "pooling":  {"mode": "boundary", "tokens": 100},
     "attention": {"mode": "FA-SSA", "sink": 128, "window": 512, ...},   # what it was trained with
     "training": {...free-form summary...},
     "retrieval": {"method": ..., "scores": [[...] x num_kv_heads] x num_layers, "calibration": {...}},  # optional
     "sha256": "<hex of router.safetensors>"}

``retrieval``: the retrieval-head ranking the fail-safe floor (``ElasticConfig.fa_floor``) keeps FA: each KV
head's attention mass on needle tokens under dense attention (``train/ranking.py``), and which calibration
prompts measured it. Optional: checkpoints without it load; a floor > 0 with one of them fails at startup.

Tensors are the ``ElasticRouter`` state dict: ``layers.{i}.cls_feat_extractor.{0,2}.{weight,bias}``
and ``layers.{i}.cls_router_head_agnostic.{0,2,4}.{weight,bias}``, float32.
Weights are read only through safetensors (no pickle anywhere); the file's sha256 is
checked against the metadata, so a truncated or corrupted file fails with a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elastic_vllm.models import sha256_file as _sha256  # also the name vllm_plugin/state.py imports
from elastic_vllm.router.model import ElasticRouter

FORMAT = "elastic-vllm-router"
FORMAT_VERSION = 1
WEIGHTS_FILE = "router.safetensors"
META_FILE = "router.json"


class RouterCheckpointError(ValueError):
    """A router checkpoint is missing, malformed, corrupted or for another model."""


class BackboneShape(BaseModel):
    """The attention shape a router is bound to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)

    def describe(self) -> str:
        return f"layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> BackboneShape:
        """From a transformers PretrainedConfig (or vLLM's hf_config)."""
        cfg = getattr(cfg, "text_config", None) or cfg
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(num_layers=cfg.num_hidden_layers, num_kv_heads=kv, head_dim=head_dim)


class BackboneMeta(BackboneShape):
    model_config = ConfigDict(extra="allow", frozen=True)

    id: str = "unknown"
    model_type: str = "unknown"


class RouterSpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    hidden_mult: int = Field(4, ge=1, le=64)


class RetrievalRanking(BaseModel):
    """KV heads' retrieval scores [num_layers][num_kv_heads] (higher = more retrieval), and how they were measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = (
        "attention mass on the needle's value tokens while the model reads out the answer, under dense attention, "
        "mean over the answer queries, the query heads of the KV head and the calibration prompts"
    )
    scores: list[list[float]]
    calibration: dict[str, Any] = Field(default_factory=dict)


class RouterMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    backbone: BackboneMeta
    router: RouterSpec = Field(default_factory=RouterSpec)
    pooling: dict[str, Any] = Field(default_factory=lambda: {"mode": "boundary", "tokens": 100})
    attention: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    retrieval: RetrievalRanking | None = None
    sha256: str = ""

    @property
    def shape(self) -> BackboneShape:
        b = self.backbone
        return BackboneShape(num_layers=b.num_layers, num_kv_heads=b.num_kv_heads, head_dim=b.head_dim)

    @property
    def hidden_mult(self) -> int:
        return self.router.hidden_mult


@dataclass
class RouterCheckpoint:
    router: ElasticRouter
    meta: RouterMeta
    path: Path


def save_router(
    router: ElasticRouter, path: str | Path, meta: RouterMeta, weights_dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``router`` to folder ``path`` (created). Returns the folder.

    ``weights_dtype=torch.float16`` stores the MLP weights in half precision (half the file; the
    loader computes in float32 either way); the input standardization always stays float32."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if meta.shape != BackboneShape(
        num_layers=router.num_layers,
        num_kv_heads=meta.backbone.num_kv_heads,
        head_dim=router.head_dim,
    ):
        raise RouterCheckpointError(
            f"metadata shape ({meta.shape.describe()}) does not match the router "
            f"(layers={router.num_layers}, head_dim={router.head_dim})"
        )
    tensors = {
        k: v.detach().to("cpu", torch.float32 if k in NORM_KEYS else weights_dtype).contiguous()
        for k, v in router.state_dict().items()
    }
    wpath = out / WEIGHTS_FILE
    save_file(tensors, str(wpath), metadata={"format": FORMAT})
    spec = meta.router.model_copy(update={"hidden_mult": router.hidden_mult})
    meta = meta.model_copy(update={"sha256": _sha256(wpath), "router": spec})
    (out / META_FILE).write_text(json.dumps(meta.model_dump(), indent=2) + "\n")
    return out


def read_meta(path: str | Path) -> RouterMeta:
    folder = Path(path)
    mpath = folder / META_FILE
    if not folder.is_dir():
        raise RouterCheckpointError(
            f"router checkpoint {folder} is not a folder (expected {META_FILE} + {WEIGHTS_FILE})"
        )
    if not mpath.is_file():
        raise RouterCheckpointError(f"router checkpoint {folder} has no {META_FILE}")
    try:
        raw = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RouterCheckpointError(f"router checkpoint {mpath} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RouterCheckpointError(f"{mpath} is not an elastic-vllm router checkpoint (format != {FORMAT!r})")
    if raw.get("format_version") != FORMAT_VERSION:
        raise RouterCheckpointError(
            f"{mpath}: unsupported format_version {raw.get('format_version')!r} (this build reads {FORMAT_VERSION})"
        )
    try:
        return RouterMeta(**raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise RouterCheckpointError(f"{mpath}: invalid metadata: {problems}") from None


def check_shape(meta: RouterMeta, model: BackboneShape, model_name: str = "the model", path: Any = "") -> None:
    """Fail with an error naming both shapes when the router was trained for another model."""
    if meta.shape != model:
        diffs = [
            f"{k}: router {getattr(meta.shape, k)} vs model {getattr(model, k)}"
            for k in ("num_layers", "num_kv_heads", "head_dim")
            if getattr(meta.shape, k) != getattr(model, k)
        ]
        raise RouterCheckpointError(
            f"router checkpoint {path} was trained for {meta.backbone.id} "
            f"({meta.shape.describe()}) but {model_name} has ({model.describe()}): " + ", ".join(diffs)
        )


NORM_KEYS = {"input_shift", "input_scale"}


def expected_shapes(num_layers: int, head_dim: int, hidden_mult: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an ElasticRouter, computed without allocating it."""
    d, h = head_dim, hidden_mult * head_dim
    per_layer = {
        "cls_feat_extractor.0.weight": (h, d),
        "cls_feat_extractor.0.bias": (h,),
        "cls_feat_extractor.2.weight": (d, h),
        "cls_feat_extractor.2.bias": (d,),
        "cls_router_head_agnostic.0.weight": (h, d),
        "cls_router_head_agnostic.0.bias": (h,),
        "cls_router_head_agnostic.2.weight": (d, h),
        "cls_router_head_agnostic.2.bias": (d,),
        "cls_router_head_agnostic.4.weight": (2, d),
        "cls_router_head_agnostic.4.bias": (2,),
    }
    return {f"layers.{i}.{k}": v for i in range(num_layers) for k, v in per_layer.items()}


def load_router(
    path: str | Path,
    expect: BackboneShape | None = None,
    model_name: str = "the model",
    device: str | torch.device = "cpu",
) -> RouterCheckpoint:
    """Load and validate a router checkpoint folder.

    Checks, in order: metadata, shape against ``expect`` (the serving model), file integrity
    (sha256), tensor names and shapes. Every failure raises RouterCheckpointError naming the problem.
    """
    folder = Path(path)
    meta = read_meta(folder)
    if expect is not None:
        check_shape(meta, expect, model_name, folder)
    wpath = folder / WEIGHTS_FILE
    if not wpath.is_file():
        raise RouterCheckpointError(f"router checkpoint {folder} has no {WEIGHTS_FILE}")
    digest = _sha256(wpath)
    if meta.sha256 and digest != meta.sha256:
        raise RouterCheckpointError(
            f"{wpath} is truncated or corrupted: sha256 {digest[:12]}... does not match "
            f"{meta.sha256[:12]}... recorded in {META_FILE}"
        )
    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise RouterCheckpointError(f"{wpath} is truncated or corrupted: {e}") from None
    # the layer count from router.json is checked against the file before anything is sized by it (a corrupted
    # count of 2**40 would otherwise enumerate 10 * 2**40 expected names)
    file_layers = {k.split(".", 2)[1] for k in tensors if k.startswith("layers.") and k.count(".") >= 2}
    if len(file_layers) != meta.backbone.num_layers:
        raise RouterCheckpointError(
            f"{wpath}: {META_FILE} says num_layers={meta.backbone.num_layers}, but the file holds tensors for "
            f"{len(file_layers)} layers"
        )
    expected = expected_shapes(meta.backbone.num_layers, meta.backbone.head_dim, meta.hidden_mult)
    norm_shape = (meta.backbone.num_layers, meta.backbone.num_kv_heads, meta.backbone.head_dim)
    if NORM_KEYS & set(tensors):  # optional input standardization: both tensors or neither
        expected.update({k: norm_shape for k in NORM_KEYS})
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise RouterCheckpointError(
            f"{wpath}: tensor names do not match a {meta.backbone.num_layers}-layer router "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{'...' if len(extra) > 3 else ''})"
        )
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise RouterCheckpointError(
                f"{wpath}: tensor {k} has shape {tuple(tensors[k].shape)}, expected {shape} "
                f"for head_dim {meta.backbone.head_dim}"
            )
        if not torch.isfinite(tensors[k]).all():
            raise RouterCheckpointError(f"{wpath}: tensor {k} holds NaN or inf values")
    # shapes verified against the file: allocating the router cannot blow up on bad metadata
    router = ElasticRouter(meta.backbone.num_layers, meta.backbone.head_dim, meta.hidden_mult)
    if "input_shift" in tensors:
        if not (tensors["input_scale"] > 0).all():
            raise RouterCheckpointError(f"{wpath}: tensor input_scale has values <= 0")
        router.set_input_norm(tensors["input_shift"], tensors["input_scale"])
    router.load_state_dict({k: t.float() for k, t in tensors.items()})
    router.to(device).eval().requires_grad_(False)
    if meta.retrieval is not None:
        router.retrieval_scores = ranking_scores(meta, folder)
    return RouterCheckpoint(router=router, meta=meta, path=folder)


def ranking_scores(meta: RouterMeta, path: Any = "") -> torch.Tensor:
    """float32 [num_layers, num_kv_heads] retrieval scores of ``meta.retrieval``, checked (shape, finite)."""
    b = meta.backbone
    scores = meta.retrieval.scores
    if len(scores) != b.num_layers or any(len(row) != b.num_kv_heads for row in scores):
        raise RouterCheckpointError(
            f"{path}: {META_FILE} retrieval.scores must be [{b.num_layers} layers][{b.num_kv_heads} KV heads], got "
            f"{len(scores)} rows of {sorted({len(row) for row in scores})} values"
        )
    t = torch.tensor(scores, dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise RouterCheckpointError(f"{path}: {META_FILE} retrieval.scores hold NaN or inf values")
    return t


def add_ranking(path: str | Path, ranking: RetrievalRanking) -> Path:
    """Store ``ranking`` in the router.json of checkpoint folder ``path`` (the weights stay as they are: the
    checkpoint is loaded, i.e. checked, first). Returns the folder."""
    folder = Path(path)
    meta = load_router(folder).meta.model_copy(update={"retrieval": ranking})
    ranking_scores(meta, folder)
    (folder / META_FILE).write_text(json.dumps(meta.model_dump(), indent=2) + "\n")
    return folder
