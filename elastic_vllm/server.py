"""A ``vllm serve --attention-backend elastic`` subprocess (through ``elastic-vllm serve``), for the demo,
the end-to-end tests and the benchmarks: start, wait until /health answers, stop with SIGINT. A benchmark's
baseline (``backend`` another vLLM backend) runs plain ``vllm serve`` the same way.

The wrapper prepares Prometheus multiprocess mode, so the ``elastic:`` metrics recorded in the engine
process appear on the server's /metrics.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeError(RuntimeError):
    """``elastic-vllm serve`` stopped (or never came up): ``cause`` is the log line saying why
    (:func:`supervisor.root_cause`), ``log_path`` the whole log (kept)."""

    def __init__(self, what: str, cause: str, log_path: Path, tail: str = ""):
        super().__init__(f"{what}: {cause} (full log: {log_path})" + (f"\n{tail}" if tail else ""))
        self.cause = cause
        self.log_path = log_path


class ServeProcess:
    """``elastic-vllm serve MODEL --host 127.0.0.1 --port P [args]`` in its own process group; with ``backend``
    other than "elastic", ``vllm serve MODEL --attention-backend BACKEND ...`` (vLLM alone, nothing of ours)."""

    def __init__(
        self,
        model: str | Path,
        elastic: dict | None = None,
        args: list[str] | None = None,
        port: int | None = None,
        served_name: str | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        backend: str = "elastic",
    ) -> None:
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.served_name = served_name or Path(str(model)).name
        if backend == "elastic":
            argv = [sys.executable, "-m", "elastic_vllm.cli", "serve", str(model)]
        elif elastic is not None:
            raise ValueError(f"elastic settings need backend 'elastic', not {backend!r}")
        else:
            argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
            argv += ["--attention-backend", backend]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.served_name]
        if elastic is not None:
            argv += ["--additional-config", json.dumps({"elastic": elastic})]
        argv += list(args or [])
        self.argv = argv
        # as typed on a shell: "elastic-vllm serve ..." / "vllm serve ..."
        self.command = " ".join(["elastic-vllm" if backend == "elastic" else "vllm", *argv[3:]])
        run_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
        run_env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the wrapper makes a fresh one
        run_env.update(env or {})
        self._own_log = log_path is None  # a temporary log: removed by stop() unless the server failed
        self.failed = False
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="elastic-serve-", suffix=".log")[1])
        )
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            argv, env=run_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started = time.time()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def log_size(self) -> int:
        """Bytes of log so far: ``log_since(size)`` later reads what the server wrote in between."""
        self._log.flush()
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def wait_ready(self, timeout_s: float = 600, progress=None) -> str:
        """Block until /health answers 200; raise with the server's log tail if it exits or times out."""
        while True:
            if self.proc.poll() is not None:
                self.failed = True
                raise self._error(f"vllm serve exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.base
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            waited = time.time() - self.started
            if waited > timeout_s:
                self.failed = True
                self.stop()
                raise self._error(f"vllm serve not ready after {timeout_s:.0f} s")
            if progress:
                progress(waited)
            time.sleep(2)

    def _error(self, what: str) -> ServeError:
        from elastic_vllm.supervisor import root_cause

        log = self.log_path.read_text(errors="replace")
        return ServeError(what, root_cause(log) or "no error line in the log", self.log_path, log[-4000:])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        if self._own_log and not self.failed and self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lab = head.partition("{")
        if metric != name:
            continue
        pairs = dict(p.split("=", 1) for p in lab.rstrip("}").split(",") if "=" in p)
        pairs = {k: v.strip('"') for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total
