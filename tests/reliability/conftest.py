"""Fixtures of the reliability tests.

Everything that boots vLLM starts in the background as soon as the session has collected the tests
that need it, so that the boots overlap each other and the fast tests (a `vllm serve` start costs
~70 CPU-seconds here: API server, engine core and worker each import vLLM):

- the shared server (``server`` fixture, package scope: test_faults, test_odd_requests and test_soak
  use the same one; it is stopped after the last of them);
- the bad startups of test_startup_validation: a few real `elastic-vllm serve` that must exit with an
  error, and one process that builds an in-process vLLM engine for every bad configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from elastic_vllm.server import ServeProcess

from .serving import SharedServer, subprocess_env
from .startup_cases import API_SERVER_CASES, CASES, SERVE_CASES

HERE = Path(__file__).resolve().parent
SERVER_MODULES = {
    "test_faults.py",
    "test_odd_requests.py",
    "test_soak.py",
    "test_isolation.py",
    "test_operator_control.py",
}
STARTUP_MODULES = {"test_startup_validation.py", "test_fail_fast.py"}
BAD_START_TIMEOUT_S = 900
BAD_START_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "64M", "--max-model-len", "1024"]

_jobs: dict[str, object] = {}


class StartupJobs:
    """The bad startups, all launched at once."""

    def __init__(self) -> None:
        from elastic_vllm.models import fetch_demo_model

        self.tmp = Path(tempfile.mkdtemp(prefix="elastic-bad-start-"))
        model = fetch_demo_model(quiet=True)
        configs = {name: case.build(self.tmp / "routers") for name, case in CASES.items()}
        (self.tmp / "configs.json").write_text(json.dumps(configs, indent=1))
        self.engine_out = self.tmp / "engines.json"
        self.engine_log_path = self.tmp / "engines.log"
        env = {**os.environ, **subprocess_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(HERE.parent)])
        self._engine_log = open(self.engine_log_path, "w")  # closed in stop()
        self.engines = subprocess.Popen(
            [sys.executable, str(HERE / "engine_startup.py"), str(model), str(self.tmp / "configs.json"),
             str(self.engine_out)],
            env=env, stdout=self._engine_log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.serves = {
            name: ServeProcess(
                model,
                elastic=configs[name]["elastic"],
                args=BAD_START_ARGS,
                served_name="smollm2",
                env=subprocess_env(),
                log_path=self.tmp / f"serve-{name}.log",
            )
            for name in SERVE_CASES
        }
        for name in API_SERVER_CASES:  # the whole additional_config (elastic_ops beside elastic), as vLLM reads it
            self.serves[name] = ServeProcess(
                model,
                args=[*BAD_START_ARGS, "--additional-config", json.dumps(configs[name])],
                served_name="smollm2",
                env=subprocess_env(),
                log_path=self.tmp / f"serve-{name}.log",
            )
        self.exit_s: dict[str, float] = {}  # seconds from start to exit of each bad `elastic-vllm serve`
        for name, srv in self.serves.items():
            threading.Thread(target=self._time_exit, args=(name, srv), daemon=True).start()

    def _time_exit(self, name: str, srv: ServeProcess) -> None:
        try:
            srv.proc.wait(timeout=BAD_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return
        self.exit_s[name] = time.time() - srv.started

    def serve_result(self, name: str) -> tuple[int | None, str]:
        """(exit code, log) of a bad `elastic-vllm serve`; exit code None when it was still running after
        the timeout (then stopped)."""
        srv = self.serves[name]
        try:
            rc = srv.proc.wait(timeout=BAD_START_TIMEOUT_S)
            self.exit_s.setdefault(name, time.time() - srv.started)  # when the timing thread has not yet run
        except subprocess.TimeoutExpired:
            rc = None
        srv.stop()
        return rc, srv.log_path.read_text(errors="replace")

    def engine_results(self) -> dict:
        try:
            self.engines.wait(timeout=BAD_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.engines.pid, 9)
            self.engines.wait()
        self._engine_log.close()
        log = self.engine_log_path.read_text(errors="replace")
        assert self.engine_out.is_file(), f"engine_startup.py wrote no results:\n{log[-4000:]}"
        return json.loads(self.engine_out.read_text())

    def stop(self) -> None:
        for srv in self.serves.values():
            srv.stop()
        if self.engines.poll() is None:
            os.killpg(self.engines.pid, 9)
            self.engines.wait()
        if not self._engine_log.closed:
            self._engine_log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _selected(session, modules: set[str]) -> bool:
    return any(Path(str(item.path)).parent == HERE and Path(str(item.path)).name in modules for item in session.items)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    if _selected(session, SERVER_MODULES) and "server" not in _jobs:
        _jobs["server"] = SharedServer()
    if _selected(session, STARTUP_MODULES) and "startup" not in _jobs:
        _jobs["startup"] = StartupJobs()


def pytest_sessionfinish(session, exitstatus):
    for key in ("server", "startup"):
        job = _jobs.pop(key, None)
        if job is not None:
            job.stop()


@pytest.fixture(scope="package")
def server() -> SharedServer:
    """The shared `elastic-vllm serve` (started after collection, or here when it was not)."""
    srv = _jobs.get("server") or _jobs.setdefault("server", SharedServer())
    try:
        yield srv.wait_ready()
    finally:
        _jobs.pop("server", None)
        srv.stop()


@pytest.fixture(scope="session")
def startup_jobs() -> StartupJobs:
    jobs = _jobs.get("startup") or _jobs.setdefault("startup", StartupJobs())
    return jobs
