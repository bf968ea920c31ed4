"""benchmarks/load_ramp.py: the report (off / on per step, the 2x target, the bias levels' accuracy runs) on made-up
runs, the /metrics poller against a stand-in server, and the whole ramp on the CPU build (two real `vllm serve`
with the elastic backend, load policy off / on, vLLM's own client)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "load_ramp.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import load_ramp  # noqa: E402


def _step(mult: float, p99: float, bias: list[float], biased: int = 0) -> dict:
    s = {"median_ttft_ms": p99 / 2, "p99_ttft_ms": p99, "request_throughput": 10.0, "output_throughput": 320.0,
         "failed": 0, "completed": 20}  # fmt: skip
    samples = [[i * 0.5, b] for i, b in enumerate(bias)]
    vals = [b for _, b in samples]
    return {"multiple": mult, "rate": 10 * mult, "prompts": 20, "summary": s, "omega_msr_mean": 0.5,
            "load_biased_requests": biased,
            "bias": {"samples": samples, "n": len(vals), "max": max(vals), "mean": sum(vals) / len(vals)}}  # fmt: skip


def test_report_compares_steps_and_prices_the_biases_reached():
    off = {"steps": [_step(1.0, 400, [0, 0]), _step(2.0, 3000, [0, 0]), _step(3.0, 9000, [0])]}
    on = {"steps": [_step(1.0, 400, [0, 8]), _step(2.0, 1500, [8, 32], 17)],  # the 3x step missing: not compared
          "bias_series": {"samples": [[0, 0.0], [1, 8.0], [2, 32.0], [3, 8.0], [4, 0.0]]}}  # fmt: skip
    rows = load_ramp.compare(off, on)
    assert [r["multiple"] for r in rows] == [1.0, 2.0]
    assert rows[1]["p99_ttft_off_over_on"] == 2.0 and rows[1]["p99_ttft_ms"] == [3000, 1500]
    assert rows[1]["bias_max"] == [0, 32] and rows[1]["load_biased_requests"] == [0, 17]
    (t,) = load_ramp.targets(rows)
    assert t["met"] and t["value"].startswith("2.00x")
    assert not load_ramp.targets(load_ramp.compare(off, {"steps": [_step(2.0, 2500, [0])]}))[0]["met"]  # 1.2x
    acc = load_ramp.accuracy_cost(on, "demo")
    assert acc["biases_reached"] == [8.0, 32.0] and acc["sa_margins"] == [-8.0, -32.0]
    assert """--variant 'load32={"sa_margin": -32}'""" in acc["command"] and "--suite generalization" in acc["command"]
    assert "command" not in load_ramp.accuracy_cost(on, "llama")  # dummy weights: no accuracy to price
    assert load_ramp.step_prompts(2.0, 10.0, {"step_s": 12, "min_prompts": 16, "max_prompts": 100}) == 100
    assert load_ramp.step_prompts(0.5, 1.0, {"step_s": 12, "min_prompts": 16, "max_prompts": 100}) == 16
    assert load_ramp.step_prompts(1.5, 1.0, {"step_s": 12, "min_prompts": 16, "max_prompts": 100}) == 18


def test_poller_records_the_gauge_of_its_model():
    values = iter([0.0, 8.0, 32.0] + [16.0] * 1000)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            with lock:
                v = next(values)
            body = (
                "# HELP elastic:load_bias x\n# TYPE elastic:load_bias gauge\n"
                f'elastic:load_bias{{model_name="demo"}} {v}\nelastic:load_bias{{model_name="other"}} 99.0\n'
            ).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        poller = load_ramp.BiasPoller(f"http://127.0.0.1:{srv.server_address[1]}", "demo", 0.02)
        deadline = time.time() + 10
        while len(poller.samples) < 5 and time.time() < deadline:
            time.sleep(0.02)
        poller.stop()
    finally:
        srv.shutdown()
    vals = [b for _, b in poller.samples]
    assert vals[:4] == [0.0, 8.0, 32.0, 16.0] and poller.present and poller.failures == 0
    times = [t for t, _ in poller.samples]
    assert times == sorted(times)
    w = poller.window(times[1], times[2])
    assert w["max"] == 32.0 and w["n"] == 2 and w["mean"] == 20.0


@pytest.mark.slow
def test_dry_ramp_off_and_on_through_vllms_client(tmp_path):
    """The ramp end to end on the CPU build: both servers (tiny Llama shape, 32 tokens a scheduler step: every
    step's backlog is many scheduler steps, whatever the machine's speed, since prompts per step scale with the
    measured saturating rate) run their burst and every step to completion; the policy-on server's bias rises
    above 0 at the highest step and biases requests, the policy-off server's gauge is on /metrics and stays 0."""
    out = tmp_path / "ramp.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(out)], capture_output=True, text=True,
                       cwd=ROOT, timeout=1200)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "load_ramp" and d["environment"]["git_commit"] and d["environment"]["vllm"]
    assert d["sat_rate"] > 0 and d["sat_rate"] == d["servers"]["off"]["measured_sat_rate"]
    steps = d["options"]["steps"]
    for label in ("off", "on"):
        rec = d["servers"][label]
        assert not rec.get("error"), rec.get("error")
        assert rec["elastic_config"]["load_policy"] == {"enabled": label == "on"}  # the one difference
        assert rec["burst"]["summary"]["completed"] == d["options"]["burst"]
        assert [s["multiple"] for s in rec["steps"]] == steps
        for s in rec["steps"]:
            why = (label, s["summary"], s["client"].get("request_errors"), rec.get("server_log_tail", "")[-1500:])
            assert s["summary"]["completed"] == s["prompts"] and s["summary"]["failed"] == 0, why
            assert s["client"]["request_rate"] == s["rate"]
            assert s["bias"]["n"] > 0 and s["elastic_requests"] == s["prompts"]
        assert rec["bias_series"]["present"] and rec["bias_series"]["samples"]
    off, on = d["servers"]["off"], d["servers"]["on"]
    assert all(b == 0.0 for _, b in off["bias_series"]["samples"])
    assert all(s["load_biased_requests"] == 0 for s in off["steps"])
    top = on["steps"][-1]
    assert top["multiple"] == max(steps) and top["bias"]["max"] > 0 and top["load_biased_requests"] > 0
    rows = d["comparison"]
    assert [row["multiple"] for row in rows] == steps
    assert all(row["p99_ttft_off_over_on"] > 0 for row in rows)
    assert [t["what"] for t in d["targets"]] == ["2x the saturating rate: p99 TTFT off / on >= 1.5x"]
    assert d["accuracy"]["biases_reached"] and max(d["accuracy"]["biases_reached"]) <= 32.0
    md = out.with_suffix(".md").read_text()
    assert "| 2x |" in md and "p99 off / on" in md


def test_report_pairs_servers_of_separate_runs(tmp_path):
    """--report runs nothing: the committed GPU ramp, split back into its off and on runs, pairs into the same steps,
    keeps the runs' machine, versions and commit, and names both runs' commands."""
    whole = json.loads((ROOT / "benchmarks/results/load-ramp-demo-h100.json").read_text())
    parts = []
    for label in ("off", "on"):
        part = {**whole, "servers": {label: whole["servers"][label]}}
        parts.append(tmp_path / f"{label}.json")
        parts[-1].write_text(json.dumps(part))
    out = tmp_path / "ramp.json"
    cmd = [sys.executable, str(SCRIPT), "--report", "--merge", *map(str, parts), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["comparison"] == whole["comparison"] and len(d["comparison"]) == 5
    assert d["targets"] == whole["targets"] and d["targets"][0]["met"] is False
    env = d["environment"]
    assert env["gpu"] == whole["environment"]["gpu"] and env["git_commit"] == whole["environment"]["git_commit"]
    assert "--report" in env["report_command"]
    md = out.with_suffix(".md").read_text()
    assert "| 2x | 70.1 | 841 | 5696 / 3706 | 9284 / 8576 | 1.08x |" in md
    assert md.count("--servers") == 2  # the run and the one merged after it


def test_report_needs_files_to_pair(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--report", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--report needs --merge" in proc.stderr
