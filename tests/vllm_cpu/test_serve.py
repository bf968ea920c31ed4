"""``vllm serve MODEL --attention-backend elastic``: a real server (API server + spawned engine process)
on loopback, queried with the official ``openai`` client. /metrics (prometheus_client multiprocess mode)
shows the engine process's elastic counters, which proves the elastic forward ran in the spawned engine."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest
import requests

pytestmark = pytest.mark.slow

STARTUP_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(demo_model_dir, trained_router, tmp_path_factory):
    prom = tmp_path_factory.mktemp("prom")
    port = _free_port()
    cfg = {"elastic": {"router_path": str(trained_router), "sink": 8, "window": 32}}
    argv = [
        "vllm", "serve", str(demo_model_dir), "--attention-backend", "elastic",
        "--additional-config", json.dumps(cfg), "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", "256M", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # a spawned engine
    env.update(PROMETHEUS_MULTIPROC_DIR=str(prom), VLLM_TARGET_DEVICE="cpu")
    log = open(prom.parent / "serve.log", "w")  # closed in teardown
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {proc.returncode}:\n{(prom.parent / 'serve.log').read_text()[-4000:]}"
                )
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve not ready after {STARTUP_S}s")
            time.sleep(2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_openai_completions_and_chat_run_the_elastic_path(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    comp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert comp.choices[0].text.strip()
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a primary color of light. Answer with one word."}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].message.content.strip()
    forced = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
        extra_body={"vllm_xargs": {"elastic_force": "all-SA"}},
    )
    assert forced.choices[0].message.content is not None
    with pytest.raises(BadRequestError, match=r"elastic_force: must be one of 'auto', 'all-FA', 'all-SA'"):
        client.completions.create(
            model="smollm2", prompt="Hi", max_tokens=2, extra_body={"vllm_xargs": {"elastic_force": "sparse"}}
        )

    metrics = requests.get(server + "/metrics", timeout=10).text
    assert _metric(metrics, "elastic:attention_forward_calls_total") >= 30 * 3
    assert _metric(metrics, "elastic:routed_rows_total") >= 3
    assert _metric(metrics, "elastic:requests_total", model_name="smollm2", override="auto") >= 2
    assert _metric(metrics, "elastic:requests_total", model_name="smollm2", override="all-SA") >= 1
    assert re.search(r'^elastic:head_decisions_total\{.*decision="FA"', metrics, re.M)
