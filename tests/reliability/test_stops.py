"""Normal stops of a real `elastic-vllm serve` (demo model, CPU build) exit 0, whatever vLLM's shutdown or a
client wrote into the log: the exit code comes from the processes (`elastic_vllm/supervisor.py`).

``ELASTIC_STOP_N`` servers (default 10) are started one after the other and stopped the two ways an operator
does: SIGTERM to the wrapper (systemd, Kubernetes) and SIGINT to its process group (Ctrl-C), alternately. Before
its stop each answers a request; the first two (one per way) also get a request whose ``vllm_xargs`` carries
the word vLLM logs when its engine is gone (``EngineDeadError``) on `/v1/messages` and `/v1/chat/completions`:
refused with 400, and the stop after it still exits 0. vLLM's shutdown force-kills its engine core now and then
and logs ``EngineDeadError`` itself (2 of 7 stops, before the exit code came from the processes).

Each boot takes 1-2.5 minutes on the 2-core CPU machine: run it apart from the shared server's modules.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from elastic_vllm.server import ServeProcess

from .serving import MODEL_NAME, SERVE_ARGS, STARTUP_S, subprocess_env

pytestmark = pytest.mark.slow

STOPS = int(os.environ.get("ELASTIC_STOP_N", "10"))
PLANTED = {"elastic_force": "EngineDeadError"}
WAYS = ("SIGTERM to the wrapper", "SIGINT to the group")


def _planted_requests(c: httpx.Client) -> None:
    for path, body in (
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = c.post(path, json={"model": MODEL_NAME, "max_tokens": 2, "vllm_xargs": PLANTED, **body})
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert "elastic_force" in r.text and "EngineDeadError" in r.text, r.text[:300]


@pytest.mark.parametrize("i", range(STOPS))
def test_a_normal_stop_exits_0(i, tmp_path):
    from elastic_vllm.models import fetch_demo_model

    way = WAYS[i % 2]
    srv = ServeProcess(
        fetch_demo_model(quiet=True), args=SERVE_ARGS, served_name=MODEL_NAME, env=subprocess_env(),
        log_path=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        srv.wait_ready(STARTUP_S)
        with httpx.Client(base_url=srv.base, timeout=300) as c:
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200, r.text[:300]
            if i < 2:
                _planted_requests(c)
        if way == "SIGTERM to the wrapper":
            os.kill(srv.proc.pid, signal.SIGTERM)
        else:
            os.killpg(srv.proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        try:
            rc = srv.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 120 s after {way}:\n{srv.log_tail()}")
        log = srv.log_path.read_text(errors="replace")
        assert rc == 0, f"{way}: exit code {rc} after {time.monotonic() - t0:.1f} s:\n{log[-3000:]}"
        assert "elastic-vllm serve: error" not in log, log[-3000:]
    finally:
        srv.stop()
