"""Soak on the shared `elastic-vllm serve`: N requests (ELASTIC_SOAK_N, default 60) at 16 concurrent,
prompt lengths 10..1500 tokens (spread evenly in log), routing modes auto / all-FA / all-SA in turn through the
per-request override, every 10th request streamed and cancelled by the client after its first token.

Routing is recorded exactly once per request that reached the end of its prompt. Every answered
request did; so did every cancelled one, because a streamed chunk carries a generated token, which
vLLM produces only after the whole prompt has been prefilled (and the backend records the routing in
that same step, before the output leaves the engine). So, over the soak, by mode:

    delta elastic:requests_total{override=m} == answered(m) + cancelled(m)   (and the Omega_MSR count)

Afterwards, with the server idle: no routing state is held (elastic:live_requests == 0, and
vllm:num_requests_running == 0), and the resident memory of the server's process tree (API server,
engine core, worker) grew by less than 15% over the soak, measured after a warmup that already ran
every prompt length and mode. The figures go to $ELASTIC_SOAK_OUT (e.g. benchmarks/results/soak-cpu.json)
when set, else to a temporary file, and are printed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from elastic_vllm.server import metric_value

from .serving import MAX_MODEL_LEN, MODEL_NAME, delta, prompt_ids, tree_rss, wait_until

pytestmark = pytest.mark.slow

N = int(os.environ.get("ELASTIC_SOAK_N", "60"))
CONCURRENCY = 16
MODES = ("auto", "all-FA", "all-SA")
MIN_LEN, MAX_LEN = 10, 1500
CANCEL_EVERY = 10
RSS_GROWTH_MAX = 0.15


def plan(n: int, seed: int) -> list[dict]:
    """n requests; prompt lengths evenly spaced in log between MIN_LEN and MAX_LEN (both included: mean
    ~300 tokens), in random order."""
    rng = random.Random(seed)
    lo, hi = math.log(MIN_LEN), math.log(MAX_LEN)
    lengths = [round(math.exp(lo + (hi - lo) * k / max(1, n - 1))) for k in range(n)]
    rng.shuffle(lengths)
    out = []
    for i, length in enumerate(lengths):
        out.append(
            {
                "ids": prompt_ids(rng, length),
                "mode": MODES[i % len(MODES)],
                "max_tokens": rng.randint(1, 12),
                "cancel": i % CANCEL_EVERY == CANCEL_EVERY - 1,
            }
        )
    return out


async def one(client: httpx.AsyncClient, req: dict) -> str:
    """'answered', 'cancelled', or what went wrong."""
    body = {"model": MODEL_NAME, "prompt": req["ids"], "max_tokens": req["max_tokens"], "temperature": 0}
    body["ignore_eos"] = True
    if req["mode"] != "auto":
        body["vllm_xargs"] = {"elastic_force": req["mode"]}
    try:
        if not req["cancel"]:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text[:300]}"
            usage = r.json()["usage"]
            ok = usage["completion_tokens"] == req["max_tokens"] and usage["prompt_tokens"] == len(req["ids"])
            return "answered" if ok else f"wrong usage {usage}"
        body.update(stream=True, max_tokens=256)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"stream error {event['error']}"
                    if event.get("choices"):
                        return "cancelled"  # leaving the block drops the connection mid-stream
            return "stream ended before a token"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


async def run(base: str, reqs: list[dict], concurrency: int) -> list[str]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as client:

        async def guarded(req):
            async with sem:
                return await one(client, req)

        return await asyncio.gather(*(guarded(r) for r in reqs))


def idle(server) -> bool:
    m = server.metrics()
    return metric_value(m, "elastic:live_requests") == 0 and metric_value(m, "vllm:num_requests_running") == 0


def test_soak(server, tmp_path):
    pid = server.pid
    rss_ready = server.rss_ready
    rss_cold = tree_rss(pid)
    # warmup: every mode, the longest prompt, a cancellation, at the soak's concurrency
    warm = plan(CANCEL_EVERY, seed=1)
    warm_out = asyncio.run(run(server.base, warm, CONCURRENCY))
    assert all(o in ("answered", "cancelled") for o in warm_out), warm_out
    assert wait_until(lambda: idle(server), 60)
    rss_warm = tree_rss(pid)

    reqs = plan(N, seed=2)
    m0 = server.metrics()
    t0 = time.time()
    outcomes = asyncio.run(run(server.base, reqs, CONCURRENCY))
    seconds = time.time() - t0
    idle_after = wait_until(lambda: idle(server), 60)
    m1 = server.metrics()
    rss_after = tree_rss(pid)

    errors = [o for o in outcomes if o not in ("answered", "cancelled")]
    cancelled = outcomes.count("cancelled")
    routed = Counter(r["mode"] for r, o in zip(reqs, outcomes) if o in ("answered", "cancelled"))
    recorded = {m: delta(m0, m1, "elastic:requests_total", override=m) for m in MODES}
    figures = {
        "requests": N,
        "concurrency": CONCURRENCY,
        "errors": len(errors),
        "http_5xx": sum(o.startswith("HTTP 5") for o in outcomes),
        "cancelled": cancelled,
        "answered": outcomes.count("answered"),
        "prompt_tokens": int(delta(m0, m1, "vllm:prompt_tokens_total")),
        "generation_tokens": int(delta(m0, m1, "vllm:generation_tokens_total")),
        "preemptions": int(delta(m0, m1, "vllm:num_preemptions_total")),
        "routings_recorded": recorded,
        "routings_expected": {m: routed.get(m, 0) for m in MODES},
        "live_requests_after": metric_value(m1, "elastic:live_requests"),
        "num_requests_running_after": metric_value(m1, "vllm:num_requests_running"),
        "rss_ready_mib": round(rss_ready / 2**20, 1),  # right after the server came up
        "rss_before_warmup_mib": round(rss_cold / 2**20, 1),  # after the other tests of the shared server
        "rss_before_mib": round(rss_warm / 2**20, 1),  # after the warmup: the soak's baseline
        "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_growth": round(rss_after / rss_warm - 1, 4),
        "seconds": round(seconds, 1),
        "server_boot_seconds": round(server.ready_s or 0, 1),
        "prompt_lengths": [MIN_LEN, MAX_LEN],
        "modes": list(MODES),
        "cancel_every": CANCEL_EVERY,
        "max_model_len": MAX_MODEL_LEN,
        "machine": f"{os.cpu_count()} CPUs",
        "env": _env(),
    }
    out = Path(os.environ.get("ELASTIC_SOAK_OUT") or tmp_path / "soak-cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nsoak figures ({out}):\n{json.dumps(figures, indent=2)}")

    assert not errors, f"{len(errors)} failed requests: {errors[:5]}"
    assert cancelled == N // CANCEL_EVERY
    assert recorded == {m: float(routed.get(m, 0)) for m in MODES}, figures
    assert delta(m0, m1, "elastic:request_omega_msr_count") == sum(routed.values())
    msr_sum = delta(m0, m1, "elastic:request_omega_msr_sum")  # all-SA: 1 each, all-FA: 0, auto: in [0, 1]
    assert routed["all-SA"] - 1e-6 <= msr_sum <= routed["all-SA"] + routed["auto"] + 1e-6
    assert idle_after, f"state not released when idle: {figures}"
    assert rss_after <= rss_warm * (1 + RSS_GROWTH_MAX), figures


def test_server_log_is_clean(server):
    """After everything the shared server went through (faults, odd requests, soak): the engine and its
    worker logged no error, no invalid override reached the worker (admission refuses them all), no
    routing metric failed to record, no re-routing after preemption differed."""
    log = server.log()
    bad = [
        line
        for line in log.splitlines()
        if re.search(r"\((EngineCore|Worker)[^)]*\).* (ERROR|CRITICAL) ", line)
        or any(s in line for s in ("EngineDeadError", "using the server default", "elastic-vllm: recording"))
        or "re-routed after preemption with a different decision" in line
    ]
    assert not bad, "\n".join(bad[:40])
    assert metric_value(server.metrics(), "elastic:attention_forward_calls_total") > 0  # the elastic path ran
    assert server.serve.proc.poll() is None


def _env() -> dict:
    """Versions and commit for the result file."""
    import platform
    import subprocess
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[2]
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout)
    except OSError:  # no git on this machine: the file says so
        git, dirty = "", None
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "vllm": version("vllm"),
        "git_commit": git or None,
        "git_dirty": dirty,
        "command": "ELASTIC_SOAK_N=300 ELASTIC_SOAK_OUT=benchmarks/results/soak-cpu.json "
        "python3 -m pytest tests/reliability/test_soak.py -s",
    }
