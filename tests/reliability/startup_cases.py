"""Bad startup configurations of the elastic backend and the error text each must produce.

Each case is a function ``build(root) -> additional_config`` that writes what it needs (router
checkpoints) under ``root``, and the fragments that the one error line must contain. Used by
``conftest.py`` (which starts the engines in the background right after collection),
``engine_startup.py`` (in-process vLLM engines, one per case) and ``test_startup_validation.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def save_router(path: Path, layers: int = LAYERS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, seed: int = 0):
    import torch
    from vllm_cpu.routers import save_test_router

    from elastic_vllm.router.model import ElasticRouter

    torch.manual_seed(seed)
    return save_test_router(ElasticRouter(layers, head_dim), path, kv_heads, "other" if layers != LAYERS else MODEL_ID)


def _weights(path: Path) -> Path:
    return path / "router.safetensors"


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], dict]  # root -> additional_config
    error: str  # the exception class named on the error line
    fragments: tuple[str, ...]  # each must appear on that one line


def _router_cfg(path: Path, **elastic) -> dict:
    return {"elastic": {"router_path": str(path), **elastic}}


def _other_model(root: Path) -> dict:
    return _router_cfg(save_router(root / "other-model", layers=24, kv_heads=8, head_dim=128))


def _other_layers(root: Path) -> dict:
    return _router_cfg(save_router(root / "other-layers", layers=24))


def _other_kv_heads(root: Path) -> dict:
    return _router_cfg(save_router(root / "other-kv", kv_heads=8))


def _other_head_dim(root: Path) -> dict:
    return _router_cfg(save_router(root / "other-hd", head_dim=128))


def _truncated(root: Path) -> dict:
    path = save_router(root / "truncated")
    w = _weights(path)
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # e.g. an interrupted copy
    return _router_cfg(path)


def _truncated_no_digest(root: Path) -> dict:
    path = save_router(root / "truncated-nodigest")
    meta = json.loads((path / "router.json").read_text())
    meta["sha256"] = ""  # no recorded digest: safetensors itself must refuse the file
    (path / "router.json").write_text(json.dumps(meta))
    w = _weights(path)
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return _router_cfg(path)


def _corrupted(root: Path) -> dict:
    path = save_router(root / "corrupted")
    w = _weights(path)
    blob = bytearray(w.read_bytes())
    for i in range(len(blob) // 2, len(blob) // 2 + 64):  # same size, flipped bytes inside the tensor data
        blob[i] ^= 0x5A
    w.write_bytes(bytes(blob))
    return _router_cfg(path)


def _missing_router(root: Path) -> dict:
    return _router_cfg(root / "does-not-exist")


def _good(root: Path) -> Path:
    path = root / "good"
    return path if (path / "router.json").is_file() else save_router(path)


def _unknown_mode(root: Path) -> dict:
    return _router_cfg(_good(root), mode="SA-FA")


def _invalid_values(root: Path) -> dict:
    return _router_cfg(_good(root), window=0, sink=-1, xattn_threshold=1.5)


def _bad_config(root: Path) -> dict:  # several problems at once: every one is named
    return _router_cfg(_good(root), mode="SA-FA", window=0)


def _unknown_field(root: Path) -> dict:
    return _router_cfg(_good(root), windw=512)


def _block_stride(root: Path) -> dict:
    return _router_cfg(_good(root), xattn_block=100, xattn_stride=16)


def _not_an_object(root: Path) -> dict:
    return {"elastic": [1, 2]}


def _bad_ops(root: Path) -> dict:
    return {**_router_cfg(_good(root)), "elastic_ops": "fast"}


def _bad_ops_type(root: Path) -> dict:
    return {**_router_cfg(_good(root)), "elastic_ops": 1}


SHAPE = "router checkpoint"
CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case(
            "other_model",
            _other_model,
            "RouterCheckpointError",
            (
                "was trained for other (layers=24, kv_heads=8, head_dim=128)",
                "has (layers=30, kv_heads=3, head_dim=64)",
                "num_layers: router 24 vs model 30",
                "num_kv_heads: router 8 vs model 3",
                "head_dim: router 128 vs model 64",
            ),
        ),
        Case("other_layers", _other_layers, "RouterCheckpointError", ("num_layers: router 24 vs model 30",)),
        Case("other_kv_heads", _other_kv_heads, "RouterCheckpointError", ("num_kv_heads: router 8 vs model 3",)),
        Case("other_head_dim", _other_head_dim, "RouterCheckpointError", ("head_dim: router 128 vs model 64",)),
        Case(
            "truncated",
            _truncated,
            "RouterCheckpointError",
            ("truncated/router.safetensors is truncated or corrupted", "does not match", "recorded in router.json"),
        ),
        Case(
            "truncated_no_digest",
            _truncated_no_digest,
            "RouterCheckpointError",
            ("truncated-nodigest/router.safetensors is truncated or corrupted",),
        ),
        Case(
            "corrupted",
            _corrupted,
            "RouterCheckpointError",
            ("corrupted/router.safetensors is truncated or corrupted: sha256", "does not match"),
        ),
        Case("missing_router", _missing_router, "RouterCheckpointError", ("does-not-exist is not a folder",)),
        Case(
            "unknown_mode",
            _unknown_mode,
            "ConfigError",
            ("invalid elastic config: elastic.mode:", "'FA-SSA', 'FA-XA' or 'XA-SSA'", "(got 'SA-FA')"),
        ),
        Case(
            "invalid_values",
            _invalid_values,
            "ConfigError",
            ("elastic.window:", "(got 0)", "elastic.sink:", "(got -1)", "elastic.xattn_threshold:", "(got 1.5)"),
        ),
        Case(
            "bad_config",
            _bad_config,
            "ConfigError",
            ("invalid elastic config: elastic.mode:", "(got 'SA-FA')", "elastic.window:", "(got 0)"),
        ),
        Case("unknown_field", _unknown_field, "ConfigError", ("elastic.windw: unknown field",)),
        Case(
            "xattn_block_stride",
            _block_stride,
            "ConfigError",
            ("xattn_block (100) must be a multiple of xattn_stride (16)",),
        ),
        Case("not_an_object", _not_an_object, "ConfigError", ("elastic must be a JSON object, got list",)),
        Case("bad_ops", _bad_ops, "ValueError", ("elastic_ops / ELASTIC_VLLM_OPS: must be one of", "(got 'fast')")),
        Case(
            "bad_ops_type", _bad_ops_type, "ValueError", ("elastic_ops / ELASTIC_VLLM_OPS: must be one of", "(got 1)")
        ),
    ]
}

# through a real `elastic-vllm serve` (API server + engine core + worker processes: ~70 CPU-seconds each
# here, so one per error class); every case runs in an in-process engine (engine_startup.py)
SERVE_CASES = ("other_model", "bad_config")
# what `elastic-vllm serve` cannot check before starting vLLM (it reads the elastic config and the router only):
# refused by the check in vLLM's API-server process, before the engine starts
API_SERVER_CASES = ("bad_ops",)
