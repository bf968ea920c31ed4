#!/usr/bin/env python3
"""CPU serving benchmark: ``vllm serve`` with the demo model, elastic vs vLLM's own CPU backend (CPU_ATTN),
measured with vLLM's own benchmark client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs;
called in-process so its ~50 s import is paid once).

    python3 benchmarks/cpu_serving.py [--model DIR] [--share S | --share auto [--router DIR]] [--out FILE.json]

For each backend, one server (``vllm serve`` for CPU_ATTN, ``elastic-vllm serve`` for elastic, which also
sets up the Prometheus multiprocess folder), then two runs of the client over the OpenAI completions
API with streaming:

- ``ttft``: prompts of 2K / 4K / ~8K tokens (the client's ``random`` dataset: random token ids of the
  served model's tokenizer), one at a time (max concurrency 1), 16 output tokens each: time to first
  token per prompt length (one client run per length, the first one after a warm-up request);
- ``throughput``: 4 prompts of 2K tokens at once (max concurrency 4), 32 output tokens each: request and
  token throughput, TTFT and time per output token under load.

Elastic serves FA-SSA (sink 128, window 2048) with a fixed-share router (``--share``, default 0.75:
``_routers.fixed_share_router``, the last round(share x 30) of the demo model's 30 layers SA whatever the input, so
Omega_MSR 22/30 = 0.733 for 0.75), so the prefill work is close to the GPU benchmark's 0.75 rows and the requests,
carrying no share, are routed by the same path as in serving (a per-request ``elastic_target_omega`` would take the
router's slower torch glue path); ``--share auto``: the router's own decisions, the shipped router's (or
``--router``'s). Runs before this sent ``elastic_target_omega`` (earlier ``elastic_sa_share``) with every request,
ranked by an untrained random router.
Both servers: float32 (bf16 matmuls are ~4x slower on this CPU), eager, max_model_len 8192, vLLM's serve
defaults otherwise (chunked prefill with a 2048-token budget on CPU, so an 8K prompt arrives in 4 chunks),
prefix caching off. The elastic backend runs its PyTorch path on CPU (the Triton kernels are GPU-only).

What the numbers mean: a shared 2-core VM, one run, other work on the same cores. They show that serving
works end to end and the relative cost of the two CPU attention paths; they say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, T0, environment, log, write_json
from _routers import fixed_share_router

NAME = "smollm2"
BACKENDS = ("CPU_ATTN", "elastic")
# float32 (bf16 matmuls are ~4x slower on this CPU), eager, prefix caching off; 4 sequences in 1.5 GB of KV cache
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", "4",
               "--kv-cache-memory-bytes", "1536M", "--no-enable-prefix-caching"]  # fmt: skip
ELASTIC_METRICS = ("elastic:request_omega_msr_sum", "elastic:request_omega_msr_count",
                   "elastic:router_latency_seconds_sum", "elastic:router_latency_seconds_count",
                   "elastic:attention_forward_calls_total")  # fmt: skip


def start_server(backend: str, model: Path, router: Path | None, log_path: Path):
    """``elastic-vllm serve`` (elastic; ``router`` None: the shipped router) or plain ``vllm serve`` (the baseline),
    ready to answer."""
    from elastic_vllm.server import ServeProcess

    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    elastic = ({"router_path": str(router)} if router else {}) if backend == "elastic" else None
    srv = ServeProcess(model, elastic=elastic,
                       args=SERVER_ARGS, served_name=NAME, env=env, log_path=log_path, backend=backend)  # fmt: skip
    srv.wait_ready(600)
    srv.startup_s = time.time() - srv.started
    return srv


def elastic_metrics(srv) -> dict[str, float]:
    """The elastic counters and routing histograms of /metrics (sums over label sets)."""
    from elastic_vllm.server import metric_value

    text = srv.metrics()
    return {name: metric_value(text, name) for name in ELASTIC_METRICS}


def bench(server, model: Path, n: int, input_len: int, output_len: int, concurrency: int, warmups: int) -> dict:
    """One run of vLLM's benchmark client (the code of ``vllm bench serve``) against the server."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    argv = ["--backend", "vllm", "--base-url", server.base, "--model", NAME, "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "0", "--num-prompts", str(n), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--save-detailed", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90", "--seed", "0",
            "--num-warmups", str(warmups)]  # fmt: skip
    res = main(p.parse_args(argv))
    res["client_argv"] = "vllm bench serve " + " ".join(shlex.quote(a) for a in argv)
    return res


def summarize_ttft(res: dict, input_len: int) -> dict:
    v = res["ttfts"]
    return {"prompt_tokens": input_len, "client_input_lens": res["input_lens"], "ttft_s": [round(x, 3) for x in v],
            "median_ttft_s": round(statistics.median(v), 3), "client_argv": res["client_argv"]}  # fmt: skip


KEEP = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "mean_itl_ms", "median_itl_ms", "mean_e2el_ms")  # fmt: skip


def run(args) -> dict:
    from elastic_vllm.models import fetch_demo_model

    model = Path(args.model) if args.model else fetch_demo_model(quiet=True)
    work = Path(tempfile.mkdtemp(prefix="cpu-serving-"))
    out = Path(args.out)
    logs = out.parent / (out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    share = None if args.share == "auto" else float(args.share)
    if share is not None:
        if args.router:
            raise SystemExit("--router is for --share auto; a fixed share is served by its fixed-share router")
        router, what = fixed_share_router(model, work, share), f"fixed-share {share}"
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        omega = round(round(share * layers) / layers, 4)  # whole layers: round(share x L) of L run SA
    else:
        router = Path(args.router) if args.router else None  # None: the server finds the shipped router
        what, omega = str(router) if router else "shipped", None
    env = environment(("torch", "vllm"))
    report = {
        "what": "vllm serve on CPU, demo model: elastic vs CPU_ATTN, vLLM's benchmark client (vllm bench serve)",
        "command": env["command"],
        "git_commit": env["git_commit"],
        "machine": {"cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
        "model": str(model),
        "elastic": {
            "router": what,
            "share": share,
            # the Omega_MSR every request realizes (benchmarks/report.py reads it)
            "target_omega": omega if share is not None else "auto (router)",
            "mode": "FA-SSA",
            "sink": 128,
            "window": 2048,
        },
        "backends": {},
    }
    report["env"] = env
    write_json(out, report)
    for backend in BACKENDS:
        log(f"== {backend}: starting the server")
        entry: dict = {}
        report["backends"][backend] = entry
        srv = start_server(backend, model, router if backend == "elastic" else None, logs / f"{backend}.log")
        entry.update(startup_s=round(srv.startup_s, 1), server_argv=srv.command)
        log(f"   ready in {srv.startup_s:.0f}s")
        try:
            entry["ttft"] = {"max_concurrency": 1, "by_length": []}
            for i, n in enumerate(lengths):
                log(f"   TTFT {n} tokens x {args.reps}")
                res = bench(srv, model, args.reps, n, 16, 1, 1 if i == 0 else 0)
                entry["ttft"]["by_length"].append(summarize_ttft(res, n))
                write_json(out, report)
            log("   throughput: 4 x 2048 tokens, max concurrency 4")
            res = bench(srv, model, 4, 2048, 32, 4, 0)
            entry["throughput"] = {k: res.get(k) for k in KEEP} | {"client_argv": res["client_argv"],
                                                                   "max_concurrency": 4}  # fmt: skip
            write_json(out, report)
            if backend == "elastic":
                m = elastic_metrics(srv)
                n = m["elastic:request_omega_msr_count"]
                entry["elastic_metrics"] = {
                    "requests_routed": n,
                    "mean_omega_msr": m["elastic:request_omega_msr_sum"] / n if n else None,
                    "mean_router_latency_ms": 1e3
                    * m["elastic:router_latency_seconds_sum"]
                    / max(m["elastic:router_latency_seconds_count"], 1),
                    "attention_forward_calls": m["elastic:attention_forward_calls_total"],
                }
        finally:
            srv.stop()
        write_json(out, report)
    report["elapsed_s"] = round(time.time() - T0, 1)
    report["load_avg_at_end"] = os.getloadavg()
    report["comparison"] = compare(report)
    write_json(out, report)
    return report


def compare(report: dict) -> list[dict]:
    b = report["backends"]
    rows = []
    try:
        base = {r["prompt_tokens"]: r["median_ttft_s"] for r in b["CPU_ATTN"]["ttft"]["by_length"]}
        for r in b["elastic"]["ttft"]["by_length"]:
            if r["prompt_tokens"] in base:
                rows.append({"what": f"TTFT {r['prompt_tokens']} tokens", "CPU_ATTN": base[r["prompt_tokens"]],
                             "elastic": r["median_ttft_s"], "speedup": round(base[r["prompt_tokens"]] / r["median_ttft_s"], 3)})  # fmt: skip
        for k in ("output_throughput", "total_token_throughput", "request_throughput"):
            x, y = b["CPU_ATTN"]["throughput"][k], b["elastic"]["throughput"][k]
            rows.append({"what": k, "CPU_ATTN": round(x, 3), "elastic": round(y, 3), "speedup": round(y / x, 3)})
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    return rows


def markdown(report: dict) -> str:
    lines = [f"Run: {report['machine']['cpus']} CPUs (load average {report['machine']['load_avg_at_start'][0]:.1f} "
             f"at start), vLLM {report['env']['vllm']}, torch {report['env']['torch']}, commit "
             f"`{str(report['git_commit'])[:12]}`, {report.get('elapsed_s', '?')} s; `{report['command']}`.", "",
             "| backend | server start s | TTFT by prompt tokens (median s) | throughput run: req/s | output tok/s | "
             "total tok/s | median TTFT ms | median TPOT ms |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, e in report["backends"].items():
        if "skipped" in e:
            lines.append(f"| {name} | skipped: {e['skipped']} | | | | | | |")
            continue
        t = e.get("ttft", {})
        ttft = ", ".join(f"{r['prompt_tokens']}: {r['median_ttft_s']:.2f}" for r in t.get("by_length", []))
        h = e.get("throughput", {})

        def f(k, d=2, h=h):
            return f"{h[k]:.{d}f}" if isinstance(h.get(k), int | float) else "-"

        lines.append(f"| {name} | {e.get('startup_s', '-')} | {ttft or '-'} | {f('request_throughput', 3)} | "
                     f"{f('output_throughput')} | {f('total_token_throughput', 1)} | {f('median_ttft_ms', 0)} | "
                     f"{f('median_tpot_ms', 1)} |")  # fmt: skip
    el = report["backends"].get("elastic", {}).get("elastic_metrics")
    if el:
        msr = el["mean_omega_msr"]
        lines += ["", f"Elastic /metrics: {el['requests_routed']:.0f} requests routed, mean Omega_MSR "
                  f"{msr if msr is None else round(msr, 3)}, mean router time {el['mean_router_latency_ms']:.1f} ms per "
                  f"routing step, {el['attention_forward_calls']:.0f} elastic attention forwards."]  # fmt: skip
    if report.get("comparison"):
        lines += ["", "| | CPU_ATTN | elastic | elastic speedup |", "|---|---|---|---|"]
        for r in report["comparison"]:
            lines.append(f"| {r['what']} | {r['CPU_ATTN']} | {r['elastic']} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- cpu-serving:begin -->", "<!-- cpu-serving:end -->"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="demo model folder (default: fetched/cached by elastic-vllm fetch-model)")
    p.add_argument("--router", help="with --share auto: router folder for elastic (default: the shipped router)")
    p.add_argument("--share", default="0.75", help="SA share of the fixed-share router (whole layers), or 'auto'")
    p.add_argument("--lengths", default="2048,4096,7936", help="prompt lengths of the TTFT run (tokens)")
    p.add_argument("--reps", type=int, default=1, help="prompts per length in the TTFT run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu-serving.json"))
    p.add_argument("--report", help="results JSON -> Markdown (and --readme section) without running")
    p.add_argument("--readme", help="replace the cpu-serving section of this Markdown file")
    args = p.parse_args()
    report = json.loads(Path(args.report).read_text()) if args.report else run(args)
    md = markdown(report)
    print(md)
    if args.readme and Path(args.readme).exists():
        text = Path(args.readme).read_text()
        if BEGIN in text and END in text:
            a, rest = text.split(BEGIN, 1)
            _, b = rest.split(END, 1)
            Path(args.readme).write_text(f"{a}{BEGIN}\n{md}{END}{b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
