"""Prefix-cache isolation on the shared `elastic-vllm serve` (demo model, random router, sink 16 /
window 64, prefix caching on, as vLLM's default).

The K/V of a prompt depend on the routing mode it ran with (an SA head of layer l changes every later
layer's keys), and the router of a later request decides on the keys it reads from the cache. So a
request must never reuse blocks computed under another mode: an ``auto`` request after an ``all-SA`` (or
``all-FA``) one on the same prompt answers exactly as it does when nothing ran before, with the same
recorded routing. Requests of the same mode still share their blocks (the prefix cache keeps working).
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

from .serving import MODEL_NAME, delta, prompt_ids

pytestmark = pytest.mark.slow

GEN = 12
PROMPT_LEN = 1200  # far past sink + window (80 tokens): SA heads see a small part of it


def body(ids: list[int], force: str | None = None, salt: str | None = None) -> dict:
    b = {"model": MODEL_NAME, "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True, "logprobs": 1}  # fmt: skip
    if force:
        b["vllm_xargs"] = {"elastic_force": force}
    if salt:
        b["cache_salt"] = salt
    return b


def run(server, c: httpx.Client, b: dict) -> tuple[list[int], list[float], float, float]:
    """(token ids, their logprobs, recorded Omega_MSR, prefix-cache hit tokens) of one request."""
    m0 = server.metrics()
    r = c.post("/v1/completions", json=b)
    assert r.status_code == 200, r.text[:500]
    m1 = server.metrics()
    assert delta(m0, m1, "elastic:request_omega_msr_count") == 1
    ch = r.json()["choices"][0]
    return (
        ch["token_ids"],
        ch["logprobs"]["token_logprobs"],
        delta(m0, m1, "elastic:request_omega_msr_sum"),
        delta(m0, m1, "vllm:prefix_cache_hits_total"),
    )


@pytest.mark.parametrize("other", ["all-SA", "all-FA"])
def test_auto_answer_does_not_depend_on_an_earlier_forced_request(server, other):
    ids = prompt_ids(random.Random(f"isolation-{other}"), PROMPT_LEN)
    with httpx.Client(base_url=server.base, timeout=600) as c:
        # the reference: the same prompt with a salt of its own, so nothing is reused
        cold = run(server, c, body(ids, salt=f"cold-{uuid.uuid4()}"))
        forced = run(server, c, body(ids, force=other))
        later = run(server, c, body(ids))  # a plain client: no salt, no override
    assert forced[2] == (1.0 if other == "all-SA" else 0.0)
    assert later[2] == cold[2], f"Omega_MSR {later[2]} after an {other} request, {cold[2]} alone"
    assert later[0] == cold[0], f"the answer changed after an {other} request"
    assert later[1] == pytest.approx(cold[1], abs=1e-5), f"the logprobs changed after an {other} request"
    assert later[3] == 0, f"the auto request reused {later[3]} tokens computed under {other}"


def test_requests_of_one_mode_still_share_their_prefix(server):
    ids = prompt_ids(random.Random("isolation-share"), PROMPT_LEN)
    with httpx.Client(base_url=server.base, timeout=600) as c:
        first = run(server, c, body(ids))
        again = run(server, c, body(ids))
        sa_first = run(server, c, body(ids, force="all-SA"))
        sa_again = run(server, c, body(ids, force="all-SA"))
        salted = run(server, c, body(ids, salt="tenant-a"))  # the client's salt still separates tenants
    assert first[3] == 0 and sa_first[3] == 0 and salted[3] == 0
    assert again[3] > PROMPT_LEN // 2 and sa_again[3] > PROMPT_LEN // 2
    assert again[0] == first[0] and again[2] == first[2] and sa_again[2] == 1.0
