"""The GPU tests: ``gpu``-marked modules run on the GPU machine (``tools/gpu_session.sh kernels`` / ``check`` / ``tp``).

Where no CUDA device is present they are skipped: a hardware gate, so that CI and the CPU tiers never try them.
``--cpu-dry`` runs the tests marked ``gpu(cpu_dry=True)`` (the kernels') at toy sizes under the Triton interpreter
instead: their plumbing, checked on the CPU. On a GPU the tests refuse to run under TRITON_INTERPRET=1 (which
tests/conftest.py turns on for the CPU tests): run them alone with TRITON_INTERPRET=0, as gpu_session.sh does.

Every test records its rows (``record``: name, ok, its numbers, seconds) into ``--gpu-out``, a JSON file
``{"env": the run's record, "results": rows}`` written after every row (the device call brings it back even when it
is cut short); a test that fails without a row gets one naming the error. ``--gpu-append`` keeps the rows already in
the file (the GPU session runs each engine test in a process of its own).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    g = parser.getgroup("gpu", "the GPU tests (tests/gpu)")
    g.addoption("--gpu-out", default=None, help="JSON file of the rows the GPU tests record")
    g.addoption("--gpu-append", action="store_true", help="keep the rows already in --gpu-out (same name: replaced)")
    g.addoption("--cpu-dry", action="store_true", help="the kernel tests at toy sizes under the Triton interpreter")
    g.addoption("--model", default=None, help="the demo model folder (SmolLM2-135M-Instruct, transformers format)")
    g.addoption("--router", default=None, help="router folder for the needle / batch tests (default: constructed)")
    g.addoption("--trained-router", default=str(ROOT / "router_weights" / "smollm2-135m-instruct"))
    g.addoption("--needle-n", type=int, default=10)
    g.addoption("--needle-len", type=int, default=2000)
    g.addoption("--long-len", type=int, default=131072)
    g.addoption("--tp-time-budget", type=float, default=320.0, help="seconds for the TP test's engine steps")


def pytest_configure(config):
    if config.getoption("--cpu-dry", default=False):
        os.environ["TRITON_INTERPRET"] = "1"
    config._gpu_rows = Rows(
        config.getoption("--gpu-out", default=None), config.getoption("--gpu-append", default=False)
    )


def pytest_collection_modifyitems(config, items):
    dry = config.getoption("--cpu-dry", default=False)
    cuda = torch.cuda.is_available()
    for item in items:
        m = item.get_closest_marker("gpu")
        if m is None or cuda or (dry and m.kwargs.get("cpu_dry")):
            continue
        how = " (or --cpu-dry: its plumbing on the CPU)" if m.kwargs.get("cpu_dry") else ""
        item.add_marker(pytest.mark.skip(reason=f"no CUDA device: runs on the GPU machine{how}"))


@pytest.fixture(autouse=True)
def _gpu_gate(request):
    if request.node.get_closest_marker("gpu") is None or request.config.getoption("--cpu-dry", default=False):
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.fail("TRITON_INTERPRET is on (tests/conftest.py turns it on for the CPU tests): run the GPU tests "
                    "alone with TRITON_INTERPRET=0, as tools/gpu_session.sh does")  # fmt: skip


@pytest.fixture(scope="session")
def cpu_dry(request) -> bool:
    return bool(request.config.getoption("--cpu-dry", default=False))


@pytest.fixture(scope="session")
def dev(cpu_dry) -> torch.device:
    return torch.device("cpu" if cpu_dry else "cuda")


@pytest.fixture(scope="session")
def gpu_option(request):
    """An option of the GPU tests; one a test needs and nobody gave fails it naming the option."""

    def get(name: str, required: bool = False):
        v = request.config.getoption(name, default=None)
        if required and v is None:
            pytest.fail(f"{name}: required by this test (tools/gpu_session.sh passes it)")
        return v

    return get


class Rows:
    """The rows of this pytest run, and of the file when appending; the file rewritten after every row."""

    def __init__(self, path: str | None, append: bool):
        self.path = path
        self.env: dict = {}
        self.rows: list[dict] = []
        self.by_test: dict[str, int] = {}
        if path and append and Path(path).exists():
            old = json.loads(Path(path).read_text())
            self.env, self.rows = old.get("env", {}), old.get("results", [])

    def add(self, row: dict, nodeid: str) -> None:
        from elastic_vllm.provenance import run_record, write_json

        if "git_commit" not in self.env:
            self.env.update(run_record(("torch", "triton", *(["vllm"] if "vllm" in sys.modules else []))))
        self.rows = [r for r in self.rows if r["name"] != row["name"]] + [row]
        self.by_test[nodeid] = self.by_test.get(nodeid, 0) + 1
        write_json(self.path, {"env": self.env, "results": self.rows})


@pytest.fixture
def record(request):
    """``record(name, ok, **numbers)``: one row of this test (seconds since the test started), printed and written."""
    rows: Rows = request.config._gpu_rows
    t0 = time.perf_counter()

    def add(name: str, ok: bool, **numbers) -> dict:
        row = {"name": name, "ok": bool(ok), **numbers, "s": round(time.perf_counter() - t0, 2)}
        rows.add(row, request.node.nodeid)
        print(f"{name:<58} {'PASS' if ok else 'FAIL'} {row['s']:7.1f}s {json.dumps(numbers, default=str)[:300]}")
        return row

    return add


@pytest.fixture(scope="session")
def gpu_env(request):
    """Add keys to the run's record (e.g. the TP test's step seconds)."""
    return request.config._gpu_rows.env.update


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rows: Rows = item.config._gpu_rows
    if rep.failed and item.get_closest_marker("gpu") and not rows.by_test.get(item.nodeid):
        err = str(call.excinfo.value) if call.excinfo else rep.longreprtext
        rows.add({"name": item.name, "ok": False, "error": err[-800:], "s": round(rep.duration, 2)}, item.nodeid)
