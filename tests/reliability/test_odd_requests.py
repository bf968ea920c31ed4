"""Odd requests against a real `elastic-vllm serve` (the shared server: demo model, random router,
max_model_len 2048): each gets a correct answer (200 with generated text) or a clean 4xx naming the
problem, never a 5xx; the server answers /health after each; the routing of an answered request is
recorded once per engine request (an ``n``-sample request is n engine requests); a refused request
records nothing and leaves no per-request state behind."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from .serving import MAX_MODEL_LEN, MODEL_NAME, delta, prompt_ids, wait_until

pytestmark = pytest.mark.slow

RNG = random.Random(11)
SHORT = prompt_ids(RNG, 50)  # < 200 tokens: the first and last pool_tokens (100) overlap
LONG = prompt_ids(RNG, MAX_MODEL_LEN + 1)
MAX_TOKENS = 8
OK, BAD = 200, 400


def completion(prompt, max_tokens=MAX_TOKENS, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def chat(messages, max_tokens=MAX_TOKENS, **kw) -> dict:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


def raw(body: dict) -> str:
    """The body as JSON text with NaN / Infinity literals (Python's json writes them; httpx's json= refuses)."""
    return json.dumps(body)


def xargs(**values) -> dict:
    return {"vllm_xargs": values}


# id: (endpoint, body, status, what the answer must say / how many routings it records)
CASES = {
    "short_prompt": ("completions", completion(SHORT, ignore_eos=True), OK, 1),
    "one_token_prompt": ("completions", completion(SHORT[:1], ignore_eos=True), OK, 1),
    "prompt_at_max_length": (
        "completions",
        completion(LONG[: MAX_MODEL_LEN - MAX_TOKENS], ignore_eos=True),
        OK,
        1,
    ),
    "prompt_of_max_model_len": ("completions", completion(LONG[:MAX_MODEL_LEN]), BAD, "max_tokens"),
    "prompt_over_max_model_len": ("completions", completion(LONG), BAD, "maximum context length is 2048"),
    "empty_prompt": ("completions", completion(""), BAD, "non-empty"),
    "empty_chat_content": ("chat", chat([{"role": "user", "content": ""}], ignore_eos=True), OK, 1),
    "empty_chat_messages": ("chat", chat([]), BAD, "empty conversation"),
    "huge_max_tokens": ("completions", completion("Hi", max_tokens=100_000), BAD, "cannot be greater than max_model_len"),
    "max_tokens_over_max_model_len": (
        "completions",
        completion("Hi", max_tokens=MAX_MODEL_LEN + 1),
        BAD,
        "cannot be greater than max_model_len",
    ),
    "max_tokens_zero": ("completions", completion("Hi", max_tokens=0), BAD, "max_tokens must be at least 1"),
    "out_of_vocabulary_token": ("completions", completion([10**9]), BAD, "out of vocabulary"),
    "override_all_fa": ("completions", completion(SHORT, **xargs(elastic_force="all-FA")), OK, 1),
    "override_all_sa": ("chat", chat([{"role": "user", "content": "Hi"}], **xargs(elastic_force="all-SA")), OK, 1),
    "override_auto": ("completions", completion(SHORT, **xargs(elastic_force="auto")), OK, 1),
    "override_unknown": ("completions", completion("Hi", **xargs(elastic_force="sparse")), BAD, "elastic_force: must be one of"),
    "override_wrong_case": ("completions", completion("Hi", **xargs(elastic_force="ALL-FA")), BAD, "(got 'ALL-FA')"),
    "override_number": ("completions", completion("Hi", **xargs(elastic_force=3)), BAD, "elastic_force: must be one of"),
    "override_list": ("chat", chat([{"role": "user", "content": "Hi"}], **xargs(elastic_force=["all-FA"])), BAD, "elastic_force"),
    "override_null": ("completions", completion("Hi", **xargs(elastic_force=None)), BAD, "elastic_force"),
    "override_unknown_stream": (
        "completions",
        completion("Hi", stream=True, **xargs(elastic_force="sparse")),
        BAD,
        "elastic_force: must be one of",
    ),
    "override_unknown_chat_stream": (
        "chat",
        chat([{"role": "user", "content": "Hi"}], stream=True, **xargs(elastic_force="dense")),
        BAD,
        "elastic_force: must be one of",
    ),
    "retired_sa_share": ("completions", completion("Hi", **xargs(elastic_sa_share=0.5)), BAD, "elastic_sa_share: no longer supported; use elastic_target_omega"),
    "retired_sa_share_chat_stream": (
        "chat",
        chat([{"role": "user", "content": "Hi"}], stream=True, **xargs(elastic_sa_share=0.5)),
        BAD,
        "elastic_sa_share: no longer supported",
    ),
    "unknown_elastic_key": ("completions", completion("Hi", **xargs(elastic_forc="all-FA")), BAD, "elastic_forc: not an elastic-vllm key (known: elastic_force"),
    "xargs_not_an_object": ("completions", completion("Hi", vllm_xargs="all-FA"), BAD, "vllm_xargs"),
    # the knob in another case, with spaces around or without its underscore: refused (it used to run auto)
    **{
        f"knob_variant_{i}": (endpoint, body(**{"vllm_xargs": {key: "all-SA"}}), BAD,
                              f"vllm_xargs.{shown}: not an elastic-vllm key (did you mean elastic_force? known: "
                              "elastic_force, elastic_bias, elastic_target_omega)")
        for i, (endpoint, body, key, shown) in enumerate([
            ("completions", lambda **kw: completion("Hi", **kw), "ELASTIC_FORCE", "ELASTIC_FORCE"),
            ("chat", lambda **kw: chat([{"role": "user", "content": "Hi"}], **kw), "Elastic_force", "Elastic_force"),
            ("completions", lambda **kw: completion("Hi", **kw), " elastic_force", "' elastic_force'"),
            ("chat", lambda **kw: chat([{"role": "user", "content": "Hi"}], **kw), "elasticforce", "elasticforce"),
            ("completions", lambda **kw: completion("Hi", stream=True, **kw), "elastic-force", "elastic-force"),
        ])
    },
    # elasticity knobs: each bad value a 400 naming the field (NaN / Infinity: as Python's json writes them,
    # which FastAPI reads back; a null is refused by vLLM's own request model, naming the field too)
    "bias_ok": ("completions", completion(SHORT, **xargs(elastic_bias=-2.5)), OK, 1),
    "target_ok": ("chat", chat([{"role": "user", "content": "Hi"}], **xargs(elastic_target_omega=0.5)), OK, 1),
    "bias_nan": ("completions", raw(completion("Hi", **xargs(elastic_bias=float("nan")))), BAD, "elastic_bias: must be a finite number"),
    "bias_inf": ("completions", raw(completion("Hi", **xargs(elastic_bias=float("inf")))), BAD, "elastic_bias: must be a finite number"),
    "bias_out_of_range": ("completions", completion("Hi", **xargs(elastic_bias=5000)), BAD, "elastic_bias: must be in [-1024, 1024]"),
    "bias_string": ("completions", completion("Hi", **xargs(elastic_bias="2")), BAD, "elastic_bias: must be a number"),
    "bias_list": ("chat", chat([{"role": "user", "content": "Hi"}], **xargs(elastic_bias=[1])), BAD, "elastic_bias: must be a number"),
    "target_out_of_range": ("completions", completion("Hi", **xargs(elastic_target_omega=1.5)), BAD, "elastic_target_omega: must be in [0, 1]"),
    "target_negative": ("completions", completion("Hi", **xargs(elastic_target_omega=-0.25)), BAD, "elastic_target_omega: must be in [0, 1]"),
    "target_nan": ("completions", raw(completion("Hi", **xargs(elastic_target_omega=float("nan")))), BAD, "elastic_target_omega: must be a finite number"),
    "target_null": ("completions", completion("Hi", **xargs(elastic_target_omega=None)), BAD, "vllm_xargs.elastic_target_omega"),
    "bias_and_target": ("completions", completion("Hi", **xargs(elastic_bias=1, elastic_target_omega=0.5)), BAD, "elastic_bias: cannot be combined with elastic_target_omega"),
    "bias_with_force": ("completions", completion("Hi", **xargs(elastic_bias=1, elastic_force="all-SA")), BAD, "elastic_bias: cannot be combined with elastic_force"),
    "target_with_force": ("chat", chat([{"role": "user", "content": "Hi"}], **xargs(elastic_target_omega=0.5, elastic_force="all-FA")), BAD, "elastic_target_omega: cannot be combined with elastic_force"),
    "target_stream_out_of_range": ("completions", completion("Hi", stream=True, **xargs(elastic_target_omega=2)), BAD, "elastic_target_omega: must be in [0, 1]"),
    "load_bias_from_client": ("completions", completion("Hi", **xargs(elastic_load_bias=1.0)), BAD, "elastic_load_bias: set by the server's load policy"),
    "two_samples": ("completions", completion(SHORT, n=2, temperature=1.0, seed=3), OK, 2),
}  # fmt: skip


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base, timeout=600) as c:
        yield c


def _live(server) -> float:
    from elastic_vllm.server import metric_value

    return metric_value(server.metrics(), "elastic:live_requests")


@pytest.mark.parametrize("case", list(CASES))
def test_odd_request(server, client, case):
    endpoint, body, status, expect = CASES[case]
    m0 = server.metrics()
    url = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, str):  # already JSON (NaN / Infinity, which httpx refuses to write)
        r = client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(url, json=body)
    assert r.status_code < 500, f"{case}: HTTP {r.status_code}: {r.text[:2000]}"
    assert r.status_code == status, f"{case}: HTTP {r.status_code}: {r.text[:2000]}"
    assert client.get("/health").status_code == 200, f"server unhealthy after {case}"
    m1 = server.metrics()
    routed = delta(m0, m1, "elastic:requests_total")
    if status == OK:
        choices = r.json()["choices"]
        assert len(choices) == body.get("n", 1)
        for ch in choices:
            text = ch["message"]["content"] if endpoint == "chat" else ch["text"]
            assert isinstance(text, str) and text, f"{case}: no text in {ch}"
        if body.get("ignore_eos"):
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"] * body.get("n", 1)
        assert routed == expect, f"{case}: {routed} routings recorded, expected {expect}"
        assert delta(m0, m1, "elastic:request_omega_msr_count") == expect
        sent = body.get("vllm_xargs", {})
        force = sent.get("elastic_force", "auto")
        label = "bias" if "elastic_bias" in sent else "target-omega" if "elastic_target_omega" in sent else force
        assert delta(m0, m1, "elastic:requests_total", override=label) == expect
        if force != "auto":  # forced routing is exact: all-FA 0, all-SA 1
            assert delta(m0, m1, "elastic:request_omega_msr_sum") == pytest.approx({"all-FA": 0, "all-SA": 1}[force])
        if "elastic_target_omega" in sent:  # a budget is exact: round(0.5 x 30 layers x 3 KV heads) / 90
            assert delta(m0, m1, "elastic:request_omega_msr_sum") == pytest.approx(45 / 90)
            assert delta(m0, m1, "elastic:requested_target_omega_sum") == pytest.approx(sent["elastic_target_omega"])
        if "elastic_bias" in sent:
            assert delta(m0, m1, "elastic:requested_bias_sum") == pytest.approx(sent["elastic_bias"])
    else:
        err = r.json()["error"]
        assert expect in err["message"], f"{case}: {err}"
        assert err.get("code") == status and r.headers["content-type"].startswith("application/json")
        assert routed == 0, f"{case}: a refused request recorded a routing"
    # per-request state is released (a finished request is freed at the engine's next step)
    assert wait_until(lambda: _live(server) == 0, 30), f"{case}: elastic:live_requests stays {_live(server)}"


@pytest.mark.parametrize(
    "extra,status,expect",
    [
        ({"elastic_force": "fast"}, BAD, "sampling_params.extra_args.elastic_force: must be one of 'auto'"),
        ({"ELASTIC_FORCE": "all-SA"}, BAD, "sampling_params.extra_args.ELASTIC_FORCE: not an elastic-vllm key"),
        ({"elastic_bias": 5000}, BAD, "sampling_params.extra_args.elastic_bias: must be in [-1024, 1024]"),
        ({"elastic_force": "all-SA"}, OK, None),
    ],
)
def test_token_endpoint_errors_name_its_own_field(server, client, extra, status, expect):
    """vLLM's token endpoint takes the SamplingParams themselves: its errors name sampling_params.extra_args, the
    field its clients wrote, not the OpenAI endpoints' vllm_xargs."""
    m0 = server.metrics()
    body = {"model": MODEL_NAME, "token_ids": SHORT[:20], "sampling_params": {"max_tokens": 2, "extra_args": extra}}
    r = client.post("/inference/v1/generate", json=body)
    assert r.status_code == status, r.text[:2000]
    if status == BAD:
        assert expect in r.text and "vllm_xargs" not in r.text, r.text[:2000]
        assert delta(m0, server.metrics(), "elastic:requests_total") == 0
    else:
        assert delta(m0, server.metrics(), "elastic:requests_total", override=extra["elastic_force"]) == 1


def test_still_serving_after_the_odd_requests(server, client):
    r = client.post("/v1/completions", json=completion(SHORT, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    stream = client.post("/v1/completions", json=completion("Once upon a time", stream=True))
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
