"""benchmarks/serve_bench.py: the report (ratios, targets, merging runs per server and workload) on made-up client
results, and the whole benchmark on the CPU build (real `vllm serve` with the elastic backend, vLLM's own client)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_bench.py"


def _run(ttft: float, thr: float, tpot: float = 10.0, jit: int = 0) -> dict:
    s = {"output_throughput": thr, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot}
    return {"summary": s, "jit": ["x during inference"] * jit, "client": s}


def _result(servers: dict, commit: str) -> dict:
    env = {"command": f"python3 benchmarks/serve_bench.py ({commit})", "git_commit": commit, "gpu": "test GPU"}
    return {"baseline": "FLASH_ATTN", "environment": env, "servers": servers}


def test_report_merges_runs_and_computes_ratios(tmp_path):
    base = {"backend": "FLASH_ATTN", "runs": {"1k": {"cold": _run(100, 1000), "warm": _run(80, 1100)},
                                              "32k": {"warm": _run(3000, 50)}}}  # fmt: skip
    el = {"backend": "elastic", "runs": {"1k": {"cold": _run(200, 500, jit=1), "warm": _run(80, 1100)},
                                         "fa32k": {"warm": _run(9999, 1)}}}  # fmt: skip
    first = tmp_path / "a.json"
    first.write_text(json.dumps(_result({"llama-base": base, "llama-elastic": el}, "aaa")))
    # a later file replaces the elastic server's fa32k runs only (its 1k runs stay)
    second = tmp_path / "b.json"
    second.write_text(json.dumps(_result({"llama-elastic": {"runs": {"fa32k": {"warm": _run(3000, 50)}}}}, "bbb")))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--report", "--merge", str(first), str(second), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    rows = {(x["workload"], x["burst"]): x for x in d["comparison"]}
    assert rows[("1k", "cold")]["throughput"] == 0.5 and rows[("1k", "cold")]["median_ttft"] == 2.0
    assert rows[("1k", "cold")]["jit_elastic"] == 1
    assert rows[("1k", "warm")]["throughput"] == 1.0 and rows[("1k", "warm")]["ttft_speedup"] == 1.0
    assert rows[("fa32k", "warm")]["baseline_row"] == "32k" and rows[("fa32k", "warm")]["ttft_speedup"] == 1.0
    met = {t["what"].split(":")[0]: t["met"] for t in d["targets"]}
    assert met == {"1k cold": False, "1k warm": True, "fa32k": True}
    assert d["environment"]["git_commit"] == "aaa" and "report_command" in d["environment"]
    assert [m["git_commit"] for m in d["merged_from"]] == ["aaa", "bbb"]
    md = out.with_suffix(".md").read_text()
    assert "| llama | fa32k | warm | 1.00x |" in md and "not met" in md


def test_phases_are_per_burst_means_of_vllms_histograms():
    """Two /metrics scrapes around a burst give its per-request queue / prefill means (label sets summed)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_bench import metric_sums, phases

    def scrape(q_sum, q_n, p_sum):
        return "\n".join([
            "# HELP vllm:request_queue_time_seconds x",
            f'vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {q_sum / 2}',
            f'vllm:request_queue_time_seconds_sum{{engine="1",model_name="m"}} {q_sum / 2}',
            f'vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {q_n}',
            f'vllm:request_queue_time_seconds_bucket{{le="1.0"}} {q_n}',
            f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {p_sum}',
            f'vllm:request_prefill_time_seconds_count{{model_name="m"}} {q_n}',
            "vllm:iteration_tokens_total_sum 4096.0",
            "vllm:iteration_tokens_total_count 4.0",
            "elastic:requests_total 3.0",
        ])  # fmt: skip

    before, after = metric_sums(scrape(1.0, 10, 2.0)), metric_sums(scrape(5.0, 30, 3.0))
    assert before["vllm:request_queue_time_seconds_sum"] == 1.0 and "elastic:requests_total" not in before
    ph = phases(before, after)
    assert ph["queue"] == 200.0 and ph["queue_n"] == 20  # (5 - 1) s over 20 requests
    assert ph["prefill"] == 50.0
    assert "step_tokens" not in ph and "decode" not in ph  # no new steps between the scrapes, no decode histogram


@pytest.mark.slow
def test_dry_run_serves_elastic_through_vllms_client(tmp_path):
    """The benchmark end to end on the CPU build: `vllm serve --attention-backend elastic` (tiny Llama shape with
    dummy weights and the fixed-share router) driven by vLLM's client, every request completed, the elastic
    forward ran (its counters on /metrics), the all-FA override sent in the request body."""
    out = tmp_path / "dry.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--servers", "llama-elastic", "--workloads", "1k,fa32k", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    d = json.loads(out.read_text())
    rec = d["servers"]["llama-elastic"]
    assert not rec.get("error")
    for w, n in (("1k", 6), ("fa32k", 2)):
        for burst in ("cold", "warm"):
            s = rec["runs"][w][burst]["summary"]
            assert s["completed"] == n and s["failed"] == 0, (w, burst, s)
            ph = rec["runs"][w][burst]["phases"]  # vLLM's own histograms, one observation per request
            assert ph["queue_n"] == n and ph["prefill"] > 0, (w, burst, ph)
    assert '"elastic_force": "all-FA"' in rec["runs"]["fa32k"]["warm"]["client"]["_client_argv"]
    calls = [ln for ln in rec["elastic_metrics"] if ln.startswith("elastic:attention_forward_calls_total")]
    assert calls and float(calls[0].split()[-1]) > 0
