#!/usr/bin/env python3
"""Load ramp: two elastic servers, identical but for ``load_policy.enabled`` (off / on), each driven by
vLLM's benchmark client through request-rate steps past saturation, long and short prompts mixed, with the live
``elastic:load_bias`` polled from /metrics while each step runs.

    python3 benchmarks/load_ramp.py [--model demo|llama] [--sat-rate R] [--steps 0.5,1,1.5,2,3] [--out FILE.json]
    python3 benchmarks/load_ramp.py --dry      # CPU: the tiny Llama shape, 32 tokens a scheduler step

Models: ``demo`` (default), the demo model with its shipped router (serve_bench's demo-elastic server); ``llama``,
the Llama-3.1-8B shape with dummy weights and serve_bench's fixed-share router (Omega_MSR 0.75: its FA layers'
margin is 8 logits, so a load bias above 8 sends every layer to SA).

Saturating rate: ``--sat-rate`` (requests/s) or measured: the request throughput of a burst (``--burst`` prompts sent
at once) on the policy-off server. Every server runs its burst first (the off server's measures; the on server's is
its warm-up, and its capacity under a full backlog). Then the steps: step k sends ceil(steps[k] x sat x step_s)
prompts (within --min-prompts .. --max-prompts) as Poisson arrivals at steps[k] x sat requests/s (``vllm bench serve
--request-rate``), random prompts of input x (1 +- range_ratio) tokens: long and short mixed. Both servers get the
same prompts (the same seeds). The client waits for every response, so a step starts from an idle engine (where
the policy's EMA restarts at 0).

Per step: the client's JSON as written (TTFT p50 / p99, throughput), the bias series (GET /metrics every --poll-s,
in a thread) with its max and mean, vLLM's mean queue / prefill time per request, elastic's mean realized Omega_MSR
and how many requests the policy biased. Then: p99 TTFT off / on per step, the target at the 2x step (>= 1.5x), and
the bias levels reached with the accuracy run that prices them: a load bias b routes as sa_margin -b does (a head is
FA iff z_FA - z_SA > bias - sa_margin), so the served generalization suite with a variant of ``sa_margin`` -b at
the highest level reached prices them all (on the CPU build, ``--resume`` on its committed samples); the per-step
Omega_MSR places them on ``eval --suite budgets``' curve.
Writes JSON (GPU, versions, commit, command: _harness), Markdown next to it and, when matplotlib is installed, a PNG
of the bias over time and p99 TTFT per step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _harness import ROOT, environment, log, made_with, provenance, write_json
from _routers import fixed_share_router
from serve_bench import (
    DEMO_ELASTIC,
    SHARE,
    bench,
    llama_dir,
    metric_sums,
    phases,
    server_env,
    summary,
)

from elastic_vllm.server import metric_value

K = 1024
STEPS = (0.5, 1.0, 1.5, 2.0, 3.0)  # multiples of the saturating rate
TARGET_STEP, TARGET_RATIO = 2.0, 1.5  # p99 TTFT off / on at 2x the saturating rate
MODELS = {  # prompt tokens input x (1 +- range_ratio), output tokens, prompts of the first burst
    "demo": dict(input=4 * K, range_ratio=0.9, output=32, burst=256),  # 410 .. 7782 tokens: its context is 8K
    "llama": dict(input=16 * K, range_ratio=0.9, output=32, burst=32),  # 1.6K .. 31K tokens
}
GPU = dict(step_s=12.0, min_prompts=16, max_prompts=3000, poll_s=0.5, max_batched=None)
# --dry: the tiny Llama shape on the CPU; 32 tokens a scheduler step so that a step's backlog is hundreds of steps
DRY = dict(model="llama", input=384, range_ratio=0.5, output=4, step_s=4.0, burst=8, min_prompts=8, max_prompts=200,
           poll_s=0.2, max_batched=32)  # fmt: skip
BIAS = "elastic:load_bias"


# --- the live bias -----------------------------------------------------------------------------------------
class BiasPoller:
    """GET /metrics every ``period`` s in a thread: ``samples`` = [seconds since start, elastic:load_bias] (a
    scrape that fails or times out is skipped; ``present``: whether the gauge was on /metrics at all)."""

    def __init__(self, base: str, model_name: str, period: float) -> None:
        self.url, self.model_name, self.period = base + "/metrics", model_name, period
        self.t0 = time.time()
        self.samples: list[list[float]] = []
        self.present = False
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bias-poller", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return round(time.time() - self.t0, 3)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = self.now()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    text = r.read().decode()
                self.present = self.present or f"{BIAS}{{" in text
                self.samples.append([t, metric_value(text, BIAS, model_name=self.model_name)])
            except Exception:  # a scrape lost under load: a gap in the series, never an error of the run
                self.failures += 1
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, t0: float, t1: float) -> dict:
        got = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        vals = [b for _, b in got]
        return {"samples": got, "n": len(vals), "max": max(vals, default=0.0),
                "mean": round(sum(vals) / len(vals), 3) if vals else 0.0}  # fmt: skip


def elastic_counts(text: str, name: str) -> dict[str, float]:
    """The elastic counters a step's deltas are taken of: realized Omega_MSR (sum, count) and load-biased requests."""
    return {
        "msr_sum": metric_value(text, "elastic:request_omega_msr_sum", model_name=name),
        "msr_n": metric_value(text, "elastic:request_omega_msr_count", model_name=name),
        "load_biased": metric_value(text, "elastic:requests_total", model_name=name, override="load-bias"),
        "requests": metric_value(text, "elastic:requests_total", model_name=name),
    }


def elastic_deltas(before: dict, after: dict) -> dict:
    n = after["msr_n"] - before["msr_n"]
    return {
        "omega_msr_mean": round((after["msr_sum"] - before["msr_sum"]) / n, 4) if n > 0 else None,
        "load_biased_requests": int(after["load_biased"] - before["load_biased"]),
        "elastic_requests": int(after["requests"] - before["requests"]),
    }


# --- one server: burst, then the steps ----------------------------------------------------------------------
def step_prompts(mult: float, sat: float, o: dict) -> int:
    return int(min(o["max_prompts"], max(o["min_prompts"], math.ceil(mult * sat * o["step_s"]))))


def run_server(label: str, model: Path, name: str, args: list[str], env: dict, o: dict, sat: float | None,
               work: Path) -> dict:  # fmt: skip
    """One elastic server: its burst, then every step at a multiple of ``sat`` (None: this server's burst
    measures it). The record of each run and the whole bias series."""
    from elastic_vllm.server import ServeProcess

    log(f"{label}: starting elastic on {model.name}")
    server = ServeProcess(model, args=args, served_name=name, env=env, log_path=work / f"server-{label}.log")
    rec: dict = {"server_argv": server.command, "steps": []}
    poller = None
    shape = {k: o[k] for k in ("input", "range_ratio", "output")}
    try:
        server.wait_ready(o["startup_s"])
        rec["startup_s"] = round(time.time() - server.started, 1)
        log(f"{label}: ready in {rec['startup_s']} s")
        poller = BiasPoller(server.base, name, o["poll_s"])

        def one(tag: str, w: dict, seed: int) -> dict:
            text = server.metrics()
            before, el_before, t0 = metric_sums(text), elastic_counts(text, name), poller.now()
            data = bench(server, model, w, seed, work, f"{label}-{tag}")
            time.sleep(max(2 * o["poll_s"], 0.5))  # the gauge's fall after the last response, in this step's window
            text, t1 = server.metrics(), poller.now()
            s = summary(data)
            r = {"summary": s, "t_start": t0, "t_end": t1, "phases": phases(before, metric_sums(text)),
                 **elastic_deltas(el_before, elastic_counts(text, name)), "bias": poller.window(t0, t1),
                 "client": data}  # fmt: skip
            log(f"{label}: {tag}: {s['completed']} done, {s['request_throughput']:.2f} req/s, TTFT median "
                f"{s['median_ttft_ms']:.0f} p99 {s['p99_ttft_ms']:.0f} ms, bias max {r['bias']['max']:g} mean "
                f"{r['bias']['mean']:g}, Omega_MSR {r['omega_msr_mean']}, load-biased {r['load_biased_requests']}")  # fmt: skip
            return r

        if o["burst"]:
            rec["burst"] = one("burst", {**shape, "prompts": o["burst"]}, seed=1)
        if sat is None:
            sat = rec["burst"]["summary"]["request_throughput"]
            rec["measured_sat_rate"] = sat
        rec["sat_rate"] = sat
        for k, mult in enumerate(o["steps"]):
            rate = round(mult * sat, 4)
            w = {**shape, "rate": rate, "prompts": step_prompts(mult, sat, o)}
            r = one(f"step{k}-{mult:g}x", w, seed=100 + k)
            rec["steps"].append({"multiple": mult, "rate": rate, "prompts": w["prompts"], "seed": 100 + k, **r})
        rec["elastic_log"] = [ln for ln in server.log_since(0).splitlines() if "elastic:" in ln][:20]
    except Exception as e:
        rec["error"] = f"{e}"[-3000:]
        log(f"{label}: ERROR {str(e)[:400]}")
    finally:
        if poller is not None:
            poller.stop()
            rec["bias_series"] = {"samples": poller.samples, "present": poller.present,
                                  "failed_scrapes": poller.failures}  # fmt: skip
        server.stop()
        rec["server_log_tail"] = server.log_tail(2000)
    return rec


# --- report -------------------------------------------------------------------------------------------------
def compare(off: dict | None, on: dict | None) -> list[dict]:
    """Per step both servers ran: p50 / p99 TTFT, throughput, the bias of the on server; p99 off / on."""
    rows = []
    by_mult = {s["multiple"]: s for s in (off or {}).get("steps", [])}
    for s_on in (on or {}).get("steps", []):
        s_off = by_mult.get(s_on["multiple"])
        if s_off is None:
            continue
        a, b = s_off["summary"], s_on["summary"]
        rows.append({
            "multiple": s_on["multiple"], "rate": s_on["rate"], "prompts": s_on["prompts"],
            "p50_ttft_ms": [a["median_ttft_ms"], b["median_ttft_ms"]], "p99_ttft_ms": [a["p99_ttft_ms"], b["p99_ttft_ms"]],
            "p99_ttft_off_over_on": round(a["p99_ttft_ms"] / b["p99_ttft_ms"], 3) if b["p99_ttft_ms"] else None,
            "request_throughput": [a["request_throughput"], b["request_throughput"]],
            "output_throughput": [a["output_throughput"], b["output_throughput"]],
            "bias_max": [s_off["bias"]["max"], s_on["bias"]["max"]], "bias_mean": [s_off["bias"]["mean"], s_on["bias"]["mean"]],
            "omega_msr_mean": [s_off["omega_msr_mean"], s_on["omega_msr_mean"]],
            "load_biased_requests": [s_off["load_biased_requests"], s_on["load_biased_requests"]],
            "failed": [a["failed"], b["failed"]],
        })  # fmt: skip
    return rows


def targets(rows: list[dict]) -> list[dict]:
    return [{"what": f"{TARGET_STEP:g}x the saturating rate: p99 TTFT off / on >= {TARGET_RATIO}x",
             "value": f"{r['p99_ttft_off_over_on']:.2f}x ({r['p99_ttft_ms'][0]:.0f} / {r['p99_ttft_ms'][1]:.0f} ms)",
             "met": r["p99_ttft_off_over_on"] >= TARGET_RATIO}
            for r in rows if r["multiple"] == TARGET_STEP and r["p99_ttft_off_over_on"] is not None]  # fmt: skip


def accuracy_cost(on: dict | None, model: str) -> dict:
    """The bias levels the on server reached and the runs that price them (not run here)."""
    series = (on or {}).get("bias_series", {}).get("samples", [])
    levels = sorted({b for _, b in series if b > 0})
    out = {"biases_reached": levels, "sa_margins": [-b for b in levels],
           "why": "a load bias b routes as sa_margin -b (FA iff z_FA - z_SA > bias - sa_margin)"}  # fmt: skip
    if model == "demo" and levels:
        # the highest level bounds the others' cost (a larger bias only sends more heads to SA): the served
        # generalization suite with it as a variant, on its committed samples (--resume runs only the new variant)
        top = f"{max(levels):g}"
        out["command"] = (
            "elastic-vllm eval --suite generalization --device cpu --out OUT --resume --variants dense elastic "
            f"""load{top} --variant 'load{top}={{"sa_margin": -{top}}}'"""
        )
        out["budgets_command"] = "bash tools/gpu_session.sh budgets  # score vs realized Omega_MSR (the steps' Omega)"
    return out


def step_table(rows: list[dict]) -> list[str]:
    """The per-step off / on table (Markdown lines): the result's own and the docs' (``benchmarks/report.py``)."""
    lines = [
        "| step | rate (req/s) | prompts | p50 TTFT (ms) | p99 TTFT (ms) | p99 off / on | req/s | out tok/s "
        "| bias max (on) | bias mean (on) | Omega_MSR | load-biased |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['p99_ttft_off_over_on']:.2f}x" if r["p99_ttft_off_over_on"] is not None else "-"
        om = " / ".join("-" if x is None else f"{x:.3f}" for x in r["omega_msr_mean"])
        lines.append(
            f"| {r['multiple']:g}x | {r['rate']:.3g} | {r['prompts']} | {r['p50_ttft_ms'][0]:.0f} / "
            f"{r['p50_ttft_ms'][1]:.0f} | {r['p99_ttft_ms'][0]:.0f} / {r['p99_ttft_ms'][1]:.0f} | {ratio} | "
            f"{r['request_throughput'][0]:.2f} / {r['request_throughput'][1]:.2f} | {r['output_throughput'][0]:.0f} / "
            f"{r['output_throughput'][1]:.0f} | {r['bias_max'][1]:g} | {r['bias_mean'][1]:.2f} | {om} | "
            f"{r['load_biased_requests'][1]} |"
        )
    return lines


def markdown(d: dict) -> str:
    env = d["environment"]
    o = d["options"]
    lines = [
        f"# Load ramp: load policy off vs on ({d['model']}, {env.get('gpu')})"
        + (" (--dry: a plumbing check, the numbers mean nothing)" if d.get("dry") else ""),
        "",
        made_with(
            {**env, "triton": None},
            d.get("merged_from", [])[1 if env.get("report_command") else 0 :],
            f"; report: `{env['report_command']}`" if env.get("report_command") else "",
        ),
        "",
        f"Saturating rate {d['sat_rate']:.3g} requests/s ({d['sat_rate_from']}); prompts {o['input']} x (1 +- "
        f"{o['range_ratio']}) tokens, {o['output']} out (`--ignore-eos`), Poisson arrivals for ~{o['step_s']:g} s a "
        f"step; load policy on: `{json.dumps(d['load_policy'])}`. Pairs are off / on.",
        "",
        *step_table(d["comparison"]),
    ]
    bursts = {k: v["burst"]["summary"] for k, v in d["servers"].items() if "burst" in v}
    if bursts:
        lines += ["", "Bursts (every prompt at once): " + "; ".join(
            f"{k}: {s['request_throughput']:.2f} req/s, p99 TTFT {s['p99_ttft_ms']:.0f} ms" for k, s in bursts.items())
            + "."]  # fmt: skip
    if d["targets"]:
        lines += ["", "| target | measured | |", "|---|---|---|"]
        lines += [f"| {t['what']} | {t['value']} | {'met' if t['met'] else 'not met'} |" for t in d["targets"]]
    acc = d["accuracy"]
    lines += ["", f"Bias levels reached (on): {acc['biases_reached'] or 'none'}."]
    if acc.get("command"):
        lines += [f"Their accuracy cost ({acc['why']}): `{acc['command']}`."]
    if d.get("plot"):
        lines += ["", f"![bias over time]({d['plot']})"]
    return "\n".join(lines) + "\n"


def plot(d: dict, path: Path) -> str | None:
    """The bias over time (each server's series, steps marked) and p99 TTFT per step; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 7))
    for label, rec in d["servers"].items():
        s = rec.get("bias_series", {}).get("samples", [])
        if s:
            ax.step([t for t, _ in s], [b for _, b in s], where="post", label=label)
        if label.endswith("on"):
            for st in rec.get("steps", []):
                ax.axvspan(st["t_start"], st["t_end"], alpha=0.08, color="grey")
                ax.annotate(
                    f"{st['multiple']:g}x", (st["t_start"], 0), fontsize=8, xytext=(2, 2), textcoords="offset points"
                )
    ax.set(xlabel="s since the server was ready", ylabel="elastic:load_bias",
           title="live load bias (shaded: the policy-on server's steps)")  # fmt: skip
    ax.legend()
    rows = d["comparison"]
    if rows:
        x = [r["multiple"] for r in rows]
        bx.plot(x, [r["p99_ttft_ms"][0] for r in rows], "o-", label="p99 TTFT, policy off")
        bx.plot(x, [r["p99_ttft_ms"][1] for r in rows], "o-", label="p99 TTFT, policy on")
        bx.set_yscale("log")
        bx.set(xlabel="request rate / saturating rate", ylabel="ms")
        bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# --- main ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), help="demo (default; --dry: llama, the tiny shape)")
    p.add_argument("--demo-model", type=Path, help="the demo model folder (default: fetch_demo_model)")
    p.add_argument("--servers", default="off,on", help="which of off,on run (a later --merge joins split runs)")
    p.add_argument("--sat-rate", type=float, help="the saturating rate, requests/s (default: the off server's burst)")
    p.add_argument("--steps", help=f"multiples of the saturating rate (default {','.join(f'{s:g}' for s in STEPS)})")
    p.add_argument("--step-s", type=float, help="seconds of arrivals a step (prompts = rate x this)")
    p.add_argument("--burst", type=int, help="prompts of each server's first burst (0: none; then --sat-rate)")
    p.add_argument("--min-prompts", type=int)
    p.add_argument("--max-prompts", type=int)
    p.add_argument("--input", type=int, help="mean prompt tokens")
    p.add_argument("--range-ratio", type=float, help="prompt tokens uniform in input x (1 +- this)")
    p.add_argument("--output", type=int, help="output tokens a request")
    p.add_argument("--max-batched", type=int, help="--max-num-batched-tokens of both servers (default vLLM's)")
    p.add_argument("--poll-s", type=float, help="seconds between /metrics scrapes")
    p.add_argument("--policy", default="{}", help="JSON: load_policy fields besides enabled (default: the config's)")
    p.add_argument("--startup-s", type=float, default=900)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/load-ramp-h200.json")
    p.add_argument("--merge", type=Path, nargs="*", default=[], help="earlier --out files: their servers are kept")
    p.add_argument("--report", action="store_true", help="run nothing: pair the --merge files' servers, write --out")
    p.add_argument("--dry", action="store_true", help="CPU plumbing check: tiny shapes")
    a = p.parse_args(argv)
    if a.report and not a.merge:
        p.error("--report needs --merge: the files whose servers it pairs")
    if a.report:  # nothing runs: no torch import (the machine and versions are the merged files')
        cuda = False
    else:
        import torch

        cuda = torch.cuda.is_available()
    base = {**DRY} if a.dry else {**GPU, **MODELS[a.model or "demo"], "model": a.model or "demo"}
    if a.dry and a.model:
        base["model"] = a.model
    o = {**base, "steps": [float(x) for x in a.steps.split(",")] if a.steps else list(STEPS),
         "startup_s": a.startup_s}  # fmt: skip
    for k in ("step_s", "burst", "min_prompts", "max_prompts", "input", "range_ratio", "output", "max_batched",
              "poll_s"):  # fmt: skip
        if getattr(a, k) is not None:
            o[k] = getattr(a, k)
    if not o["burst"] and not a.sat_rate:
        p.error("--burst 0 needs --sat-rate (the burst measures the saturating rate)")
    policy = json.loads(a.policy)
    if "enabled" in policy:
        p.error("--policy: enabled is what the two servers differ in")
    if a.demo_model is None and not a.report:
        from elastic_vllm.models import fetch_demo_model

        a.demo_model = fetch_demo_model()
    work = Path(tempfile.mkdtemp(prefix="load-ramp-"))
    env, common = server_env(cuda)
    if o["max_batched"]:
        if "--max-num-batched-tokens" in common:
            i = common.index("--max-num-batched-tokens")
            del common[i : i + 2]
        common += ["--max-num-batched-tokens", str(o["max_batched"]), "--max-num-seqs", str(min(16, o["max_batched"]))]
    if o["model"] == "demo":
        model, name, elastic, margs = a.demo_model, "demo", dict(DEMO_ELASTIC), []
    else:
        mml = math.ceil(o["input"] * (1 + o["range_ratio"])) + o["output"] + 16
        model, name = (None, "llama") if a.report else (llama_dir(work, a.demo_model, mml, a.dry), "llama")
        elastic = {} if a.report else {"router_path": str(fixed_share_router(model, work, SHARE))}
        margs = ["--load-format", "dummy", "--max-model-len", str(mml)]
    results: dict = {}
    merged_from = []
    for path in a.merge:
        d0 = json.loads(path.read_text())
        merged_from.append({"file": path.name, "command": d0["environment"]["command"],
                            "git_commit": d0["environment"]["git_commit"]})  # fmt: skip
        results.update(d0["servers"])
    sat = a.sat_rate or results.get("off", {}).get("sat_rate")
    cmd = ["python3", "benchmarks/load_ramp.py", *argv]
    if a.report:  # the machine and versions are the runs', the command is this report's
        first = json.loads(a.merge[0].read_text())
        env_rec = {**first["environment"], "report_command": provenance(cmd)["command"]}
        elastic, o = first["elastic_config"], first["options"]
    else:
        env_rec = environment(("torch", "triton", "vllm", "transformers"), cmd)

    def write() -> str:
        """JSON, Markdown and plot of the servers so far (after each server: a run cut short keeps the first)."""
        rows = compare(results.get("off"), results.get("on"))
        d = {
            "benchmark": "load_ramp",
            "environment": env_rec,
            "model": o["model"],
            "options": o,
            "sat_rate": sat if sat is not None else float("nan"),
            "sat_rate_from": "--sat-rate" if a.sat_rate else "the off server's burst",
            "elastic_config": elastic,
            "load_policy": {**policy, "enabled": True},
            "comparison": rows,
            "dry": a.dry,
            "targets": targets(rows),
            "accuracy": accuracy_cost(results.get("on"), o["model"]),
            "servers": results,
            "merged_from": merged_from,
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        d["plot"] = plot(d, a.out.with_name(a.out.stem + "-bias.png"))
        write_json(a.out, d)
        md = markdown(d)
        a.out.with_suffix(".md").write_text(md)
        return md

    for label in [] if a.report else a.servers.split(","):
        cfg = {**elastic, "load_policy": {**policy, "enabled": label == "on"}}
        args = [*common, *margs, "--additional-config", json.dumps({"elastic": cfg})]
        if sat is None and label != "off":
            p.error("no saturating rate: run the off server first, or give --sat-rate")
        results[label] = {"elastic_config": cfg, **run_server(label, model, name, args, env, o, sat, work)}
        sat = sat or results[label].get("sat_rate")
        write()
    print(write())
    errors = [k for k, v in results.items() if v.get("error")]
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
