"""``vllm serve MODEL --attention-backend elastic``: a real server (API server + spawned engine process)
on loopback, queried with the official ``openai`` client. /metrics (prometheus_client multiprocess mode)
shows the engine process's elastic counters, which proves the elastic forward ran in the spawned engine."""

from __future__ import annotations

import re

import pytest
import requests

from . import server as srv

pytestmark = pytest.mark.slow


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server():
    """The server conftest started right after collection (started here when run alone)."""
    s = srv.start()
    try:
        yield s.wait_ready()
    finally:
        srv.stop()


def test_openai_completions_and_chat_run_the_elastic_path(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [srv.MODEL_NAME]
    comp = client.completions.create(
        model=srv.MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert comp.choices[0].text.strip()
    chat = client.chat.completions.create(
        model=srv.MODEL_NAME,
        messages=[{"role": "user", "content": "Name a primary color of light. Answer with one word."}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].message.content.strip()
    forced = client.chat.completions.create(
        model=srv.MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
        extra_body={"vllm_xargs": {"elastic_force": "all-SA"}},
    )
    assert forced.choices[0].message.content is not None
    with pytest.raises(BadRequestError, match=r"elastic_force: must be one of 'auto', 'all-FA', 'all-SA'"):
        client.completions.create(
            model=srv.MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"vllm_xargs": {"elastic_force": "sparse"}}
        )

    metrics = requests.get(server + "/metrics", timeout=10).text
    assert _metric(metrics, "elastic:attention_forward_calls_total") >= 30 * 3
    assert _metric(metrics, "elastic:routed_rows_total") >= 3
    assert _metric(metrics, "elastic:requests_total", model_name=srv.MODEL_NAME, override="auto") >= 2
    assert _metric(metrics, "elastic:requests_total", model_name=srv.MODEL_NAME, override="all-SA") >= 1
    assert re.search(r'^elastic:head_decisions_total\{.*decision="(FA|SA)"', metrics, re.M)
