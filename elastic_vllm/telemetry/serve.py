"""``elastic-vllm serve``: prepare Prometheus multiprocess mode, then exec ``vllm serve``.

The routing metrics are written in the engine process; the API server's /metrics shows them
only when every process shares a fresh PROMETHEUS_MULTIPROC_DIR, set before any of them
imports prometheus_client. This wrapper creates one per run (and removes those of earlier runs
whose server is gone), adds ``--attention-backend elastic`` unless another backend is named,
defaults the model to the demo model, and replaces itself with ``vllm serve``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

PREFIX = "elastic-vllm-prom-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_multiproc_dir(base: str | None = None) -> Path:
    """A fresh, empty folder for this run; stale folders of dead runs are removed."""
    root = Path(base or tempfile.gettempdir())
    for old in root.glob(f"{PREFIX}*"):
        try:
            pid = int(old.name[len(PREFIX) :])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(old, ignore_errors=True)
    d = root / f"{PREFIX}{os.getpid()}"  # exec keeps the pid: the folder lives as long as the server
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def vllm_serve_argv(model: str, extra: list[str]) -> list[str]:
    argv = ["vllm", "serve", model, *extra]
    if not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in extra):
        argv += ["--attention-backend", "elastic"]
    return argv


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def exec_serve(model: str | None, extra: list[str]) -> None:
    if model is None:
        from elastic_vllm.models import fetch_demo_model

        model = str(fetch_demo_model())
    env = dict(os.environ)
    if env.get("PROMETHEUS_MULTIPROC_DIR"):
        d = Path(env["PROMETHEUS_MULTIPROC_DIR"])
        if d.is_dir() and any(d.iterdir()):
            print(
                f"elastic-vllm serve: PROMETHEUS_MULTIPROC_DIR={d} is not empty; metrics of an earlier run would "
                "mix with this one's. Unset it (the wrapper then makes a fresh one) or empty it.",
                file=sys.stderr,
            )
            raise SystemExit(2)
    else:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(prepare_multiproc_dir())
    if (
        not _has_cuda()
        and "VLLM_CPU_KVCACHE_SPACE" not in env
        and not any(a.startswith("--kv-cache-memory") for a in extra)
    ):
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; unbounded, vLLM's CPU build reserves most of the RAM
    argv = vllm_serve_argv(model, extra)
    print("elastic-vllm serve: exec " + " ".join(argv), file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, env)
