"""Load policy through a real `elastic-vllm serve` of its own (engine core in its own process, metrics through
prometheus_client's multiprocess folder): under a prefill backlog the `elastic:load_bias` gauge on /metrics rises
to max_bias, a plain request sent then runs with it (``override="load-bias"``), a request with its own
``elastic_bias`` keeps it, and once idle the gauge and the next request are back at 0.

Boots its own server (one at a time: run it apart from the modules of the shared server).
"""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from elastic_vllm.server import metric_value

from .serving import MODEL_NAME, own_server, prompt_ids, wait_until

pytestmark = pytest.mark.slow

MAX_BIAS = 64.0
# ema 1, high 0.5 steps: any backlog past half a step of 256 tokens gives the full bias (the smoothing and the
# levels are unit-tested in tests/vllm_cpu/test_load_policy.py); the shipped router decides
ELASTIC = {"sink": 16, "window": 64,
           "load_policy": {"enabled": True, "max_bias": MAX_BIAS, "low": 0.0, "high": 0.5, "ema": 1.0, "levels": 1}}  # fmt: skip
ARGS = [
    "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "256M", "--max-model-len", "2048",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
]  # fmt: skip


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from own_server(tmp_path_factory, "load-policy", ELASTIC, ARGS)


def test_load_bias_follows_the_backlog_over_http(srv):
    rng = random.Random("load-policy")
    errors: list[str] = []

    def send(ids, xargs=None):
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0}
        if xargs:
            body["vllm_xargs"] = xargs
        with httpx.Client(base_url=srv.base, timeout=600) as c:
            r = c.post("/v1/completions", json=body)
        if r.status_code != 200:
            errors.append(r.text[:300])

    def gauge() -> float:
        return metric_value(srv.metrics(), "elastic:load_bias", model_name=MODEL_NAME)

    m0 = srv.metrics()
    early = [threading.Thread(target=send, args=(prompt_ids(rng, 1500),)) for _ in range(4)]
    for t in early:
        t.start()
    # ~6,000 prompt tokens queued at 256 a step: the gauge reaches max_bias while they prefill
    assert wait_until(lambda: gauge() == MAX_BIAS, 120, 0.2), f"elastic:load_bias stayed {gauge()}"
    late = [
        threading.Thread(target=send, args=(prompt_ids(rng, 600),)),
        threading.Thread(target=send, args=(prompt_ids(rng, 600), {"elastic_bias": -5.0})),
    ]
    for t in late:
        t.start()
    for t in early + late:
        t.join(600)
    assert not errors, errors
    m1 = srv.metrics()

    def delta(name, **labels):
        return metric_value(m1, name, **labels) - metric_value(m0, name, **labels)

    assert delta("elastic:requests_total") == 6
    assert delta("elastic:requests_total", override="load-bias") >= 1  # the plain late request (maybe early ones)
    assert delta("elastic:requests_total", override="bias") == 1  # its own bias, kept
    assert delta("elastic:requested_bias_sum") == -5.0
    assert delta("elastic:requests_total", override="auto") >= 1  # the first one reached an idle engine
    # idle again: the next request starts from no backlog
    send(prompt_ids(rng, 300))
    assert not errors, errors
    m2 = srv.metrics()
    assert (
        metric_value(m2, "elastic:requests_total", override="auto")
        - metric_value(m1, "elastic:requests_total", override="auto")
        == 1
    )
    assert gauge() == 0.0
