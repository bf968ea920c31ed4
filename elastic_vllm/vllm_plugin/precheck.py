"""Startup checks in the process that builds the engine configuration, before any engine starts.

``vllm serve`` builds its VllmConfig in the API-server process (``EngineArgs.create_engine_config``),
then starts the engine core, whose model construction used to be the first place the elastic
configuration was read: a bad field surfaced after the engine's whole start (42-56 s on the 2-core CPU
machine) inside ~240 log lines. :func:`check_engine_config` runs right after the VllmConfig is built
(``compat.install_startup_check``; the offline ``LLM`` goes through the same call) and raises, naming
the problem and its fix, for:

- the elastic configuration and ``elastic_ops`` (``ConfigError`` / ``ValueError`` naming the field);
- the model: NeoX-RoPE architecture, no speculative decoding;
- the router checkpoint: found (``router_path`` or the shipped routers, in the documented search
  order), intact (sha256, tensor names and shapes, finite weights) and trained for this model's shape
  (from its config.json): ``RouterCheckpointError``; with ``fa_floor`` > 0, holding a retrieval-head ranking
  (``ConfigError`` naming ``elastic-vllm router-rank``);
- the Prometheus multiprocess folder, when PROMETHEUS_MULTIPROC_DIR is set: an existing folder this
  process can write to.

It also warns once, at startup, about what would otherwise degrade silently: the ``elastic:`` metrics
cannot reach /metrics (no PROMETHEUS_MULTIPROC_DIR), or the router was trained with another sink / window
than the server runs. The engine process checks everything again (``state.EngineState``): an engine
started another way fails the same, only later.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from elastic_vllm.config import ConfigError, ElasticConfig, short_repr

logger = logging.getLogger("elastic_vllm.vllm_plugin")

PROM_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Pre-RoPE key recovery inverts NeoX-style (rotate-half) RoPE, which these architectures use.
NEOX_ROPE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "granite")
ADDITIONAL_CONFIG = "--additional-config"
_warned: set[str] = set()


def warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def check_metrics_dir(env: dict[str, str] | None = None, http: bool = True) -> Path | None:
    """The Prometheus multiprocess folder when one is set (it must exist and be writable: prometheus_client
    writes one file per process into it); None when none is set, with a warning once when a /metrics
    endpoint (``http``: `vllm serve`) will miss the engine's metrics."""
    env = os.environ if env is None else env
    value = env.get(PROM_ENV)
    if not value and not http:
        return None  # an offline LLM: no /metrics, the registry of this process holds what it records
    if not value:
        warn_once(
            "metrics",
            "elastic: %s is not set, so the elastic: routing metrics (written by the engine process) do not "
            "reach /metrics; start the server with `elastic-vllm serve` (it prepares a fresh folder) or set %s "
            "to a fresh empty folder before `vllm serve`",
            PROM_ENV,
            PROM_ENV,
        )
        return None
    d = Path(value)
    if not d.is_dir():
        raise ConfigError(
            f"elastic: {PROM_ENV}={value} is not a folder (fix: create it, empty, or unset {PROM_ENV}; "
            "`elastic-vllm serve` makes a fresh one)"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".elastic-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"elastic: {PROM_ENV}={value} is not writable ({e.strerror or e}) (fix: choose a folder this user "
            f"can write to, or unset {PROM_ENV}; `elastic-vllm serve` makes a fresh one)"
        ) from None
    return d


def check_router_training(meta_attention: dict[str, Any], cfg: ElasticConfig, path: Any) -> None:
    """Warn (once per router and difference) when the router was trained with another sink / window / mode
    than the server runs: its decisions then assume SA heads that see another part of the prompt."""
    diffs = [
        f"{k} {meta_attention[k]!r} (serving {getattr(cfg, k)!r})"
        for k in ("mode", "sink", "window")
        if k in meta_attention and meta_attention[k] != getattr(cfg, k)
    ]
    if diffs:
        warn_once(
            f"training:{path}:{diffs}",
            "elastic: router %s was trained with %s; its routing decisions assume the training setting "
            "(fix: serve with the same values, or use a router trained for these)",
            path,
            ", ".join(diffs),
        )


def parse_additional_config(vllm_config) -> tuple[ElasticConfig, str | None]:
    """ElasticConfig from ``--additional-config '{"elastic": {...}}'`` (errors name the field), and
    the optional ``elastic_ops`` ("auto" | "torch" | "triton")."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"invalid elastic config: additional_config must be a JSON object, got {extra!r}")
    return ElasticConfig.parse(extra.get("elastic")), extra.get("elastic_ops")


def check_model_support(vllm_config) -> None:
    """The model features the backend needs (NeoX RoPE, no speculative decoding, a supported parallel mode); a
    ConfigError naming the one missing. Run here (the API server) and again by the engine (``state.EngineState``)."""
    from elastic_vllm.vllm_plugin import parallel

    hf = vllm_config.model_config.hf_config
    text = getattr(hf, "text_config", None) or hf
    model_type = getattr(text, "model_type", "unknown")
    if model_type not in NEOX_ROPE_MODEL_TYPES:
        raise ConfigError(
            f"elastic: model_type {model_type!r} is not supported: pre-RoPE key recovery is implemented for "
            f"NeoX-style RoPE models ({', '.join(NEOX_ROPE_MODEL_TYPES)})"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError("elastic: speculative decoding is not supported by the elastic attention backend")
    parallel.check_parallel_support(vllm_config)


def check_engine_config(vllm_config: Any, http: bool = True) -> ElasticConfig:
    """Every startup check that needs no engine (see the module docstring); raises naming the problem.
    ``http``: the process serves HTTP (`vllm serve`), whose /metrics the engine's metrics must reach."""
    import torch

    from elastic_vllm.router.checkpoint import BackboneShape, load_router
    from elastic_vllm.router.discovery import resolve_router_path
    from elastic_vllm.router.policy import floor_of
    from elastic_vllm.vllm_plugin import compat
    from elastic_vllm.vllm_plugin.ops import resolve_ops

    cfg, ops_requested = parse_additional_config(vllm_config)
    device = getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu"
    resolve_ops(ops_requested, torch.device(device if isinstance(device, str) else device.type))
    mc = vllm_config.model_config
    hf = mc.hf_config
    check_model_support(vllm_config)
    shape = BackboneShape.from_hf_config(hf)
    model_name = compat.served_model_name(vllm_config)
    path = resolve_router_path(cfg, shape, model_name)
    if path is not None:
        ck = load_router(path, expect=shape, model_name=model_name, device="cpu")
        check_router_training(ck.meta.attention, cfg, ck.path)
        floor_of(ck.router, cfg, ck.path)  # fa_floor > 0 needs the checkpoint's ranking
    check_metrics_dir(http=http)
    return cfg


def _arg(extra: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` / ``--name=VALUE`` in vLLM arguments (the last one wins, as argparse)."""
    value = None
    for i, a in enumerate(extra):
        if a == name and i + 1 < len(extra):
            value = extra[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def check_serve_args(model: str, extra: list[str]) -> None:
    """What `elastic-vllm serve` can check before starting vLLM (0.5 s for a bad field, 5 s for a router, measured
    on the 2-core CPU machine, instead of vLLM's import and engine configuration, ~16 s): ``--additional-config``
    (one JSON object), its elastic configuration and, for a local model folder, the router against its
    config.json. Anything it cannot read (a hub id, a config file) is left to the check in the API server
    (:func:`check_engine_config`), which covers everything."""
    import json
    from types import SimpleNamespace

    raw = _arg(extra, ADDITIONAL_CONFIG)
    try:
        additional = json.loads(raw) if raw is not None else {}
    except json.JSONDecodeError as e:  # vLLM's argparse says only "cannot be converted", after its ~16 s import
        raise ConfigError(
            f"{ADDITIONAL_CONFIG} is not valid JSON: {e.msg} at character {e.pos + 1} (got {short_repr(raw)})"
        ) from None
    if not isinstance(additional, dict):
        raise ConfigError(f"{ADDITIONAL_CONFIG} must be a JSON object (got {short_repr(additional)})")
    backend = _arg(extra, "--attention-backend")
    if backend is not None and backend.lower() != "elastic":
        return
    cfg = ElasticConfig.parse(additional.get("elastic"))
    config_json = Path(model) / "config.json"
    if not config_json.is_file():
        return
    try:
        hf = json.loads(config_json.read_text(), object_hook=lambda d: SimpleNamespace(**d))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return
    from elastic_vllm.router.checkpoint import BackboneShape, load_router
    from elastic_vllm.router.discovery import resolve_router_path

    try:
        shape = BackboneShape.from_hf_config(hf)
    except (AttributeError, TypeError, ValueError):
        return
    name = _arg(extra, "--served-model-name") or model
    path = resolve_router_path(cfg, shape, name)
    if path is not None:
        from elastic_vllm.router.policy import floor_of

        floor_of(load_router(path, expect=shape, model_name=name, device="cpu").router, cfg, path)
