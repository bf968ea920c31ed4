"""Operator control and faults, on an `elastic-vllm serve` of its own: the operator forces
all-SA and allows clients no override (``client_overrides: []``), then its engine core is killed.

- a client asking for all-FA or a fixed SA share gets 400 naming ``client_overrides``; a plain request
  runs all-SA and is counted under ``override="all-SA"``, the mode it ran with;
- the Prometheus folder is a private ``mkdtemp`` folder (mode 0700, no pid in its name), removed at exit;
- after ``kill -9`` of the engine core, `elastic-vllm serve` exits 1 within seconds (vLLM's API server exits 0
  there), its last line naming the engine core process that ended and the full log's path.

Boots its own server (one at a time: run it apart from the modules of the shared server).
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest

from elastic_vllm.server import metric_value
from elastic_vllm.supervisor import ENGINE_GONE_GRACE_S, KILL_AFTER_S, LEFTOVER_GRACE_S

from .serving import MODEL_NAME, SERVE_ARGS, own_server, tree_pids

pytestmark = pytest.mark.slow

ELASTIC = {"force": "all-SA", "client_overrides": [], "sink": 16, "window": 64}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from own_server(tmp_path_factory, "supervision", ELASTIC, SERVE_ARGS)


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_clients_get_only_the_overrides_the_operator_allows(srv):
    with httpx.Client(base_url=srv.base, timeout=600) as c:
        for xargs, field in (
            ({"elastic_force": "all-FA"}, "elastic_force"),
            ({"elastic_force": "all-SA"}, "elastic_force"),
            ({"elastic_target_omega": 0.5}, "elastic_target_omega"),
        ):
            body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2, "vllm_xargs": xargs}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text[:300]
            assert f"vllm_xargs.{field}" in r.text and "client_overrides" in r.text, r.text[:300]
        m0 = srv.metrics()
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        r = c.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "vllm_xargs": {"elastic_force": "auto"}},
        )
        assert r.status_code == 200, r.text[:300]  # auto (the server's own routing) is always allowed
        m1 = srv.metrics()
    assert (
        metric_value(m1, "elastic:requests_total", override="all-SA")
        - metric_value(m0, "elastic:requests_total", override="all-SA")
        == 2
    )
    assert metric_value(m1, "elastic:requests_total", override="auto") == 0


def test_engine_death_exits_nonzero_and_removes_the_metrics_folder(srv):
    pids = tree_pids(srv.proc.pid)
    prom = {_env_of(p).get("PROMETHEUS_MULTIPROC_DIR") for p in pids if p != srv.proc.pid} - {None}
    assert len(prom) == 1, prom
    prom_dir = Path(prom.pop())
    assert prom_dir.is_dir() and stat.S_IMODE(prom_dir.stat().st_mode) == 0o700
    assert str(srv.proc.pid) not in prom_dir.name and re.fullmatch(r"elastic-vllm-prom-\w{8}", prom_dir.name)

    engines = [p for p in pids if "EngineCore" in _comm(p) or "EngineCore" in _cmdline(p)]
    assert engines, [(_comm(p), _cmdline(p)[:80]) for p in pids]
    os.kill(engines[0], signal.SIGKILL)
    t0 = time.time()
    try:
        rc = srv.proc.wait(timeout=120)
    except Exception:
        pytest.fail(f"elastic-vllm serve still running 120 s after its engine died:\n{srv.log_tail()}")
    took = time.time() - t0
    log = srv.log_path.read_text(errors="replace")
    assert rc == 1, f"exit code {rc} after the engine died ({took:.0f} s):\n{log[-3000:]}"
    # the wrapper stops the server ENGINE_GONE_GRACE_S after it saw the death, then what is left of its tree (vLLM's
    # worker outlived the engine core by 52 s) LEFTOVER_GRACE_S after the server: SIGTERM, SIGKILL KILL_AFTER_S later
    assert took < ENGINE_GONE_GRACE_S + LEFTOVER_GRACE_S + 2 * KILL_AFTER_S + 10, took
    last = [line for line in log.splitlines() if line.strip()][-1]
    assert last.startswith("elastic-vllm serve: error: the engine core process (VLLM::EngineCore"), last
    assert f"pid {engines[0]})" in last and "before any stop was asked" in last and "full log: " in last, last
    assert "[vllm serve itself exited with code 0]" in last  # vLLM's own exit code: 0
    assert not prom_dir.exists(), f"{prom_dir} left behind"
