"""Which router a server loads: ``router_path``, else the shipped router whose backbone matches the model.

Shipped routers are looked for in ``$ELASTIC_VLLM_ROUTER_WEIGHTS``, the checkout's ``router_weights/`` (editable
install) and ``./router_weights``, one folder per router (``<dir>/*/router.json``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from elastic_vllm.config import ConfigError, ElasticConfig
from elastic_vllm.router.checkpoint import WEIGHTS_FILE, BackboneShape, RouterCheckpointError, read_meta
from elastic_vllm.router.checkpoint import _sha256 as checkpoint_sha256

logger = logging.getLogger("elastic_vllm.vllm_plugin")

ROUTER_DIR_ENV = "ELASTIC_VLLM_ROUTER_WEIGHTS"


def router_search_dirs() -> list[Path]:
    """Where shipped routers are looked for: $ELASTIC_VLLM_ROUTER_WEIGHTS, the repository's
    router_weights/ (editable install), ./router_weights."""
    dirs = []
    if os.environ.get(ROUTER_DIR_ENV):
        dirs.append(Path(os.environ[ROUTER_DIR_ENV]))
    dirs.append(Path(__file__).resolve().parents[2] / "router_weights")
    dirs.append(Path.cwd() / "router_weights")
    seen, out = set(), []
    for d in dirs:
        if d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def find_shipped_router(shape: BackboneShape, model_name: str) -> Path | None:
    """The shipped router folder whose router.json backbone matches ``shape``; None when there is none.
    Several matches are disambiguated by the backbone id naming the model; copies of one router (the same
    weights, sha256, and backbone id: e.g. the shipped one copied to ./router_weights) resolve to the first
    in the search order of :func:`router_search_dirs`; anything else is an error listing them. Only
    ``<dir>/*/router.json`` is read: alternatives kept one level deeper (``router_weights/alternatives/``)
    are loaded by ``router_path`` only, so the default for a backbone stays unambiguous."""
    found: list[tuple[Path, str, str]] = []  # (folder, backbone id, weights sha256)
    for root in router_search_dirs():
        if not root.is_dir():
            continue
        for meta_file in sorted(root.glob("*/router.json")):
            try:
                meta = read_meta(meta_file.parent)
            except RouterCheckpointError as e:
                logger.warning("elastic: skipping %s: %s", meta_file.parent, e)
                continue
            if meta.shape == shape:
                weights = meta_file.parent / WEIGHTS_FILE
                sha = meta.sha256 or (checkpoint_sha256(weights) if weights.is_file() else str(meta_file))
                found.append((meta_file.parent, meta.backbone.id, sha))
    if not found:
        return None
    base = Path(model_name).name.lower()
    named = [m for m in found if m[1].split("/")[-1].lower() == base]
    for candidates in (found, named):
        if candidates and len({(bid, sha) for _, bid, sha in candidates}) == 1:
            return candidates[0][0]  # one router (or copies of it): the first in the search order
    raise ConfigError(
        f"elastic: several shipped routers match {model_name} ({shape.describe()}): "
        + ", ".join(str(p) for p, _, _ in found)
        + '; choose one with --additional-config \'{"elastic": {"router_path": "..."}}\''
    )


def resolve_router_path(cfg: ElasticConfig, shape: BackboneShape, model_name: str) -> Path | str | None:
    """The router a server with ``cfg`` loads: ``router_path``, else (force auto) the shipped router for the
    model's shape; None when it runs without one (forced all-FA / all-SA). The choice is logged."""
    path = cfg.router_path
    if path is None and cfg.force == "auto":
        path = find_shipped_router(shape, model_name)
        if path is None:
            raise ConfigError(
                f"elastic: no router for {model_name} ({shape.describe()}): none of the shipped routers "
                f"in {', '.join(str(d) for d in router_search_dirs())} matches. Pass one with "
                '--additional-config \'{"elastic": {"router_path": "/path/to/router"}}\' or run without a router '
                'with {"elastic": {"force": "all-FA"}} (dense) or {"force": "all-SA"}'
            )
        logger.info(
            "elastic: router %s (the shipped router for %s; searched %s, in this order)",
            path,
            shape.describe(),
            ", ".join(str(d) for d in router_search_dirs()),
        )
    return path
