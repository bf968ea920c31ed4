"""A real ``vllm serve ... --attention-backend elastic`` for test_serve.py, started in the background as soon
as the test session has collected it (it needs ~2-3 minutes on the shared 2-core machine, mostly two Python
processes importing vLLM), so that it boots while the in-process engine tests run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import requests

STARTUP_S = 600
MODEL_NAME = "smollm2"


class Server:
    def __init__(self) -> None:
        import torch

        from elastic_vllm.models import fetch_demo_model
        from elastic_vllm.router.model import ElasticRouter

        from .routers import save_test_router

        self.tmp = Path(tempfile.mkdtemp(prefix="elastic-serve-"))
        torch.manual_seed(0)  # a random router: routing runs and is recorded (its decisions do not matter here)
        router = save_test_router(ElasticRouter(30, 64), self.tmp / "router", 3, "HuggingFaceTB/SmolLM2-135M-Instruct")
        prom = self.tmp / "prom"
        prom.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cfg = {"elastic": {"router_path": str(router), "sink": 8, "window": 32}}
        argv = [
            "vllm", "serve", str(fetch_demo_model(quiet=True)), "--attention-backend", "elastic",
            "--additional-config", json.dumps(cfg), "--dtype", "float32", "--enforce-eager",
            "--kv-cache-memory-bytes", "256M", "--max-model-len", "2048", "--max-num-seqs", "8",
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL_NAME,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # spawned engine
        env.update(PROMETHEUS_MULTIPROC_DIR=str(prom), VLLM_TARGET_DEVICE="cpu")
        self.log_path = self.tmp / "serve.log"
        self.log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.time()
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> str:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}"
                )
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return self.base
            except requests.ConnectionError:
                pass
            if time.time() - self.started > STARTUP_S:
                raise RuntimeError(f"vllm serve not ready after {STARTUP_S}s:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_server: Server | None = None


def start() -> Server:
    global _server
    if _server is None:
        _server = Server()
    return _server


def stop() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None
