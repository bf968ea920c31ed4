"""End to end: `elastic-vllm serve` (real vLLM CPU engine, demo model) scraped by a REAL Prometheus
(Debian's `prometheus`, started here on loopback with the shipped scrape config). Every PromQL expression of
the shipped Grafana dashboard must return data through Prometheus' HTTP API, and the Omega_MSR recorded for
each request must equal the routing the engine applied: 0 for all-FA, 1 for all-SA, and for auto the
routing that the transformers reference engine computes for the same token ids with the same router."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from elastic_vllm.server import ServeProcess, metric_value

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "elastic-vllm-dashboard.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ELASTIC = {"sink": 16, "window": 64}  # short prompts: keep SSA masks non-trivial


def dashboard_exprs() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p["targets"]]


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends: $__rate_interval and the $model variable ("All" = .*) substituted."""
    return expr.replace("$__rate_interval", "1m").replace("$model", ".*")


def prom_query(base: str, q: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_model_dir):
    prom_bin = shutil.which("prometheus")
    assert prom_bin, "Debian package 'prometheus' is not installed (scripts/install.sh test installs it)"
    from vllm_cpu.routers import save_test_router

    from elastic_vllm.router.model import ElasticRouter

    tmp = tmp_path_factory.mktemp("prom-e2e")
    torch.manual_seed(3)
    router = save_test_router(ElasticRouter(30, 64), tmp / "router", 3, "HuggingFaceTB/SmolLM2-135M-Instruct")
    srv = ServeProcess(
        demo_model_dir,
        elastic={**ELASTIC, "router_path": str(router)},
        args=["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "256M", "--max-model-len", "2048"],
        served_name="smollm2",
        log_path=tmp / "serve.log",
    )
    # the shipped scrape config, pointed at this server's port
    cfg = yaml.safe_load(SCRAPE.read_text())
    cfg["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{srv.port}"]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    from elastic_vllm.server import free_port

    pport = free_port()
    prom = subprocess.Popen(
        [prom_bin, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{pport}"],
        stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        srv.wait_ready(900)
        yield srv, f"http://127.0.0.1:{pport}", router
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        srv.stop()


def _one_request(srv, client, ids, force):
    m0 = srv.metrics()
    s0 = metric_value(m0, "elastic:request_omega_msr_sum")
    c0 = metric_value(m0, "elastic:request_omega_msr_count")
    extra = {"vllm_xargs": {"elastic_force": force}} if force != "auto" else None
    client.completions.create(model="smollm2", prompt=ids, max_tokens=4, temperature=0, extra_body=extra)
    m1 = srv.metrics()
    assert metric_value(m1, "elastic:request_omega_msr_count") - c0 == 1, "routing not recorded exactly once"
    return metric_value(m1, "elastic:request_omega_msr_sum") - s0


def test_dashboard_queries_and_recorded_routing(stack, demo_model_dir):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from elastic_vllm.hf import load_elastic_model

    srv, prom, router = stack
    client = OpenAI(base_url=srv.base + "/v1", api_key="unused")
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    texts = [
        "Summarize: the committee met on Tuesday and agreed to repaint the bridge in spring. " * 6,
        "def fib(n):\n    # return the n-th Fibonacci number\n" * 4,
        "Find the special magic number for apple-river: One of the special magic numbers for apple-river is 4812. "
        + "The grass is green. The sky is blue. " * 20,
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]

    # the transformers reference engine's routing of the same ids with the same router
    model, _ = load_elastic_model(demo_model_dir, {**ELASTIC, "router_path": str(router)}, str(router))
    want, logits = [], []
    for ids in prompts:
        with torch.no_grad():
            model(torch.tensor([ids]))
        st = model.elastic_state
        want.append(float((~st.last_routing[0]).float().mean()))
        lg = st.last_logits[0]
        logits.append((lg[..., 1] - lg[..., 0]).abs())

    # two rounds a scrape apart, so rate() over the dashboard's windows has samples on both sides
    seen = []
    for _round in range(2):
        for ids, w, margin in zip(prompts, want, logits):
            got = _one_request(srv, client, ids, "auto")
            # decisions may differ only where the two engines' router logits are within EPS of a tie
            near_ties = int((margin < 1e-3).sum())
            assert abs(got - w) <= near_ties / margin.numel() + 1e-6, (got, w, near_ties)
            seen.append(got)
        assert _one_request(srv, client, prompts[0], "all-FA") == pytest.approx(0.0, abs=1e-9)
        assert _one_request(srv, client, prompts[1], "all-SA") == pytest.approx(1.0, abs=1e-9)
        time.sleep(7)
    time.sleep(12)  # >= 2 more scrapes (scrape_interval 5 s in the shipped config)

    up = prom_query(prom, "up")
    assert up and up[0]["value"][1] == "1", up
    missing = []
    for title, expr in dashboard_exprs():
        res = prom_query(prom, grafana_to_promql(expr))
        if not res or all(r["value"][1] in ("NaN", "+Inf", "-Inf") for r in res):
            missing.append((title, expr))
    assert not missing, f"dashboard queries without data: {missing}"

    # the dashboard's per-mode panel sees the three override modes
    modes = {r["metric"]["override"] for r in prom_query(prom, "sum by (override) (elastic:requests_total)")}
    assert modes == {"auto", "all-FA", "all-SA"}
    # per-layer SA share covers every layer
    layers = prom_query(prom, 'count(count by (layer) (elastic:head_decisions_total{decision="SA"}))')
    assert int(float(layers[0]["value"][1])) == 30
    assert len(set(re.findall(r"\d+\.\d+", " ".join(f"{x:.3f}" for x in seen)))) >= 2  # routing differs by prompt
