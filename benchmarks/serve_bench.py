#!/usr/bin/env python3
"""Serving benchmark: ``vllm serve`` with the elastic backend against vLLM's default attention backend, driven by
vLLM's own benchmark client (``vllm bench serve``), both at vLLM's serving defaults (chunked prefill, prefix
caching, torch.compile + CUDA graphs).

    python3 benchmarks/serve_bench.py --demo-model DIR [--workloads 1k,8k,...] [--out FILE.json]
    python3 benchmarks/serve_bench.py --dry            # CPU: tiny shapes, CPU_ATTN as the baseline

One server per (model, backend); each workload runs twice on it with fresh random prompts: ``cold`` is the
first burst of that workload's shapes after the server started (the 1K workload's is the first request
burst at all), ``warm`` the second. Server logs are read between bursts for vLLM's JIT monitor warnings
(``--jit-monitor-verbose``: every Triton compilation during inference is logged).

Workloads (``WORKLOADS``): the Llama-3.1-8B shape with dummy weights and the demo model's tokenizer (its
vocabulary, 49152 ids) on one elastic server per fixed-share router (``LLAMA_ROUTERS``, built by
``_routers.fixed_share_router``: the decisions are fixed, the normal routing path computes them): whole layers SA
(Omega_MSR 0.75), and FA and SA heads mixed inside every layer as a trained router mixes them (2 FA + 6 SA KV heads,
0.75; 4 + 4, 0.5); all-FA requests (``elastic_force: all-FA`` in the request body) against the baseline's rows of the
same shape; and the demo model with its shipped router, on random 1K-7K prompts (``demo``) and on chat prompts of
the router's held-out task families packed to 1K-7K tokens (``chat``).

Writes the client's JSON of every run as written, the ratios elastic / baseline, the targets, GPU, versions
and commit to ``--out``, and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, environment, log, made_with, provenance, write_json
from _routers import fixed_share_router
from e2e_vllm import LLAMA_8B, TINY  # the model shapes of the e2e benchmark

K = 1024
JIT_MARK = "during inference"

# name: model, prompt / output tokens, prompts, concurrency, request override, the baseline row it is compared with
WORKLOADS = {
    "1k": dict(model="llama", input=1 * K, output=128, prompts=400, concurrency=64),
    "8k": dict(model="llama", input=8 * K, output=128, prompts=64, concurrency=16),
    "32k": dict(model="llama", input=32 * K, output=64, prompts=16, concurrency=4),
    "128k": dict(model="llama", input=128 * K, output=16, prompts=3, concurrency=1),
    "fa32k": dict(model="llama", input=32 * K, output=64, prompts=16, concurrency=4, force="all-FA", base="32k"),
    "fa128k": dict(model="llama", input=128 * K, output=16, prompts=3, concurrency=1, force="all-FA", base="128k"),
    # mixed chat lengths: 1K-7K tokens (the demo model's context is 8K); random token ids, or real chat prompts
    "demo": dict(model="demo", input=4 * K, range_ratio=0.75, output=128, prompts=256, concurrency=32),
    "chat": dict(model="demo", dataset="chat", input=4 * K, range_ratio=0.75, output=128, prompts=256, concurrency=32),
}
DRY = {  # --dry: the same plumbing at CPU size
    "1k": dict(model="llama", input=64, output=4, prompts=6, concurrency=3),
    "fa32k": dict(model="llama", input=160, output=4, prompts=2, concurrency=1, force="all-FA", base="32k"),
    "32k": dict(model="llama", input=160, output=4, prompts=2, concurrency=1),
    "chat": dict(model="demo", dataset="chat", input=160, range_ratio=0.5, output=4, prompts=3, concurrency=3),
}
# --dry's Llama stand-in: 8 KV heads as the 8B shape (the head-mixing routers' 2 + 6 and 4 + 4), tiny otherwise
DRY_HEADS = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 32}
# the Llama-shape elastic servers: (where the SA heads are, Omega_MSR) of each one's fixed-share router
LLAMA_ROUTERS = {
    "llama-elastic": ("layers", 0.75),
    "llama-elastic-kernels": ("layers", 0.75),
    "llama-mixed": ("heads", 0.75),
    "llama-mixed50": ("heads", 0.5),
}
# comparison rows: label -> (baseline server, elastic server, the routing in words); "llama" and "demo" are the
# labels of the results committed before the head-mixing routers
PAIRS = {
    "llama": ("llama-base", "llama-elastic", "whole layers: 8 FA + 24 SA layers (0.75)"),
    "llama, elastic kernels only": ("llama-base", "llama-elastic-kernels", "whole layers (0.75), no FlashAttention"),
    "llama, mixed 0.75": ("llama-base", "llama-mixed", "every layer 2 FA + 6 SA heads (0.75)"),
    "llama, mixed 0.5": ("llama-base", "llama-mixed50", "every layer 4 FA + 4 SA heads (0.5)"),
    "demo": ("demo-base", "demo-elastic", "the shipped router"),
}
FORCED_ON = "llama-elastic"  # all-FA requests do not consult the router: one elastic server runs them
SHARE = LLAMA_ROUTERS["llama-elastic"][1]
# the demo model's elastic server: the shipped router (found by router discovery), its training sink / window
DEMO_ELASTIC = {"sink": 128, "window": 512}
CHAT_SOURCE = ROOT / "elastic_vllm" / "eval" / "data" / "smollm2_generalization.jsonl.gz"


# --- models ---------------------------------------------------------------------------------------------
def llama_dir(work: Path, demo: Path, max_model_len: int, dry: bool) -> Path:
    """The Llama-3.1-8B config (tiny with --dry) over the demo model's tokenizer: vLLM's random dataset draws
    token ids from the tokenizer, so the vocabulary is the tokenizer's."""
    cfg = dict(LLAMA_8B)
    if dry:
        cfg.update(TINY, **DRY_HEADS, torch_dtype="float32")
    demo_cfg = json.loads((demo / "config.json").read_text())
    cfg.update(
        vocab_size=demo_cfg["vocab_size"], bos_token_id=demo_cfg.get("bos_token_id"),
        eos_token_id=demo_cfg.get("eos_token_id"), max_position_embeddings=max(max_model_len, 131072),
    )  # fmt: skip
    d = work / "llama-3.1-8b-shape"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in demo.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, d / f.name)
    return d


# --- client ----------------------------------------------------------------------------------------------
def bench(server, tokenizer: Path, w: dict, seed: int, out_dir: Path, tag: str) -> dict:
    """One run of vLLM's benchmark client: the code of ``vllm bench serve`` (``vllm.benchmarks.serve``), called in
    this process so that its import (~15 s) is paid once, not per run. Returns its result JSON as it saves it.
    ``w``: input / output tokens, range_ratio, prompts, and concurrency (``--max-concurrency``) and / or rate
    (``--request-rate``, requests/s, Poisson arrivals; without it all requests are sent at once)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    fname = f"{tag}.json"
    if w.get("dataset") == "chat":  # vLLM's custom dataset: our prompts, templated already
        path = chat_prompts(tokenizer, w, seed, out_dir / f"{tag}-prompts.jsonl")
        data_args = ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", str(w["output"]),
                     "--skip-chat-template"]  # fmt: skip
    else:
        data_args = ["--dataset-name", "random", "--random-input-len", str(w["input"]),
                     "--random-output-len", str(w["output"]), "--random-range-ratio", str(w.get("range_ratio", 0.0))]  # fmt: skip
    argv = [
        "--backend", "vllm", "--base-url", server.base,
        "--model", server.served_name, "--tokenizer", str(tokenizer), *data_args, "--num-prompts", str(w["prompts"]),
        *(["--max-concurrency", str(w["concurrency"])] if w.get("concurrency") else []),
        *(["--request-rate", str(w["rate"])] if w.get("rate") else []),
        "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", fname,
    ]  # fmt: skip
    if w.get("force"):
        argv += ["--extra-body", json.dumps({"vllm_xargs": {"elastic_force": w["force"]}})]
    p = FlexibleArgumentParser()
    add_cli_args(p)
    with _custom_dataset_without_pandas():
        main(p.parse_args(argv))
    data = json.loads((out_dir / fname).read_text())
    # the client's JSON as written, less its per-request arrays (generated texts, every ITL: ~1 MB a run)
    dropped = [k for k, v in data.items() if isinstance(v, list) and len(v) > 16]
    errors = [e for e in data.get("errors") or [] if e]  # a failed request's reason stays: it is what to fix
    data = {k: v for k, v in data.items() if k not in dropped}
    data["request_errors"] = errors[:8]
    data["_per_request_arrays_dropped"] = dropped
    data["_client_argv"] = "vllm bench serve " + " ".join(argv)
    return data


@contextlib.contextmanager
def _custom_dataset_without_pandas():
    """vLLM's custom dataset reads its JSONL with pandas, which is no vLLM dependency (the staged vLLM 0.26 on the
    GPU machine has none); here the same file is read with json, in the order written (our prompts are drawn in a
    seeded order already)."""
    from vllm.benchmarks.datasets import CustomDataset

    def load_data(self) -> None:
        with open(self.dataset_path) as f:
            self.data = [json.loads(line) for line in f if line.strip()]
        if any("prompt" not in d for d in self.data):
            raise ValueError(f"{self.dataset_path}: every line needs a 'prompt'")

    real = CustomDataset.load_data
    CustomDataset.load_data = load_data
    try:
        yield
    finally:
        CustomDataset.load_data = real


@functools.lru_cache(maxsize=2)
def _chat_sources(tokenizer: str):
    """The tokenizer, and the token ids of every CHAT_SOURCE prompt's turns (their texts a blank line apart)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    with gzip.open(CHAT_SOURCE, "rt") as f:
        recs = [json.loads(line) for line in f]
    texts = ["\n\n".join(m["content"] for m in r["messages"]) for r in recs]
    return tok, [tok(t, add_special_tokens=False).input_ids for t in texts]


def chat_prompts(tokenizer: Path, w: dict, seed: int, path: Path) -> Path:
    """``w["prompts"]`` chat prompts of input x (1 +- range_ratio) tokens each (uniform, the chat template
    included), written as vLLM's custom dataset (JSONL, a "prompt" each, templated here: the client sends them as
    they are). A prompt is a system turn naming it (so no two prompts share a cached prefix block, in a burst or
    across bursts) and a user turn of CHAT_SOURCE's prompts, the router's held-out generalization families (chat
    transcripts, code, configs, logs, tables, prose with their questions), packed in a seeded random order and cut
    from the front to the drawn length."""
    tok, ids = _chat_sources(str(tokenizer))
    rng = random.Random(seed)
    lo, hi = round(w["input"] * (1 - w["range_ratio"])), round(w["input"] * (1 + w["range_ratio"]))
    sep = tok("\n\n", add_special_tokens=False).input_ids
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(w["prompts"]):
            messages = [{"role": "system", "content": f"Session {seed}-{i}: answer from the material the user sends."}]
            head = len(
                tok.apply_chat_template([*messages, {"role": "user", "content": ""}], add_generation_prompt=True)
            )
            need = max(rng.randint(lo, hi) - head, 1)
            body: list[int] = []
            for j in rng.sample(range(len(ids)), len(ids)):
                body = ids[j] + (sep + body if body else [])
                if len(body) >= need:
                    break
            messages.append({"role": "user", "content": tok.decode(body[-need:])})
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return path


KEEP = (
    "duration", "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms",
)  # fmt: skip


def summary(d: dict) -> dict:
    return {k: d.get(k) for k in KEEP}


# vLLM's own per-request phase histograms (engine side): where a request's TTFT went, queued or in prefill steps
PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft_engine": "vllm:time_to_first_token_seconds",
    "step_tokens": "vllm:iteration_tokens_total",
}


def metric_sums(text: str) -> dict[str, float]:
    """``NAME_sum`` / ``NAME_count`` of the PHASES histograms in a /metrics text, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in PHASES.values():
            out[name] = out.get(name, 0.0) + float(value)
    return out


def phases(before: dict[str, float], after: dict[str, float]) -> dict:
    """Per-burst means from the deltas of two scrapes: ms per request for the time phases, tokens per step for
    ``step_tokens``. A phase the server does not export is absent."""
    out = {}
    for short, name in PHASES.items():
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if n > 0:
            total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
            out[short] = round(total / n if short == "step_tokens" else 1000 * total / n, 2)
            out[f"{short}_n"] = int(n)
    return out


# --- one server, its workloads --------------------------------------------------------------------------
def serve_and_run(
    label: str, model: Path, name: str, backend: str, args: list[str], workloads: list[str], table: dict,
    work: Path, env: dict, startup_s: float, save=None,
) -> dict:  # fmt: skip
    """Start the server, run each workload's cold and warm bursts, stop it. ``save(rec)`` after every burst and at
    the end: a call stopped by its time limit keeps what ran."""
    from elastic_vllm.server import ServeProcess

    log_path = work / f"server-{label}.log"
    run_env = dict(env)
    if label.endswith("-kernels"):  # the A/B of the dense dispatch: every step on the elastic kernels
        run_env["ELASTIC_VLLM_FLASH_DENSE"] = "off"
    log(f"{label}: starting {backend} on {model.name}")
    server = ServeProcess(model, args=["--jit-monitor-verbose", *args], served_name=name, env=run_env,
                          log_path=log_path, backend=backend)  # fmt: skip
    rec: dict = {"backend": backend, "model": name, "server_argv": server.command, "runs": {}}
    try:
        server.wait_ready(startup_s)
        rec["startup_s"] = round(time.time() - server.started, 1)
        log(f"{label}: ready in {rec['startup_s']} s")
        rec["startup_jit_lines"] = server.log_since(0).count(JIT_MARK)
        for wname in workloads:
            w = table[wname]
            # prompts of their own for every burst of every workload: a repeated prompt would hit the prefix cache
            base_seed = 1 + 2 * list(table).index(wname)
            for burst, seed in (("cold", base_seed), ("warm", base_seed + 1)):
                off, before = server.log_size(), metric_sums(server.metrics())
                data = bench(server, model, w, seed, work, f"{label}-{wname}-{burst}")
                jit = [ln for ln in server.log_since(off).splitlines() if JIT_MARK in ln]
                rec["runs"].setdefault(wname, {})[burst] = {
                    "summary": summary(data), "jit": jit, "phases": phases(before, metric_sums(server.metrics())),
                    "client": data,
                }  # fmt: skip
                s = summary(data)
                log(f"{label}: {wname} {burst}: {s['output_throughput']:.1f} tok/s, TTFT median "
                    f"{s['median_ttft_ms']:.0f} p99 {s['p99_ttft_ms']:.0f} ms, TPOT {s['median_tpot_ms']:.1f} ms, "
                    f"JIT {len(jit)}")  # fmt: skip
                if save is not None:
                    save(rec)
        if backend == "elastic":
            # the warm-up's report: compile time and what runs all-FA steps (FlashAttention admitted, or why not)
            rec["elastic_log"] = [ln for ln in server.log_since(0).splitlines() if "elastic:" in ln][:20]
            m = server.metrics()
            rec["elastic_metrics"] = [ln for ln in m.splitlines() if ln.startswith("elastic:") and "_bucket" not in ln]
    except Exception as e:
        rec["error"] = f"{e}"[-3000:]
        log(f"{label}: ERROR {str(e)[:400]}")
    finally:
        server.stop()
        rec["server_log_tail"] = server.log_tail(2000)
        if save is not None:
            save(rec)
    return rec


def ratios(base: dict, el: dict) -> dict:
    b, e = base["summary"], el["summary"]
    return {
        "throughput": e["output_throughput"] / b["output_throughput"],
        "median_ttft": e["median_ttft_ms"] / b["median_ttft_ms"],
        "p99_ttft": e["p99_ttft_ms"] / b["p99_ttft_ms"],
        "median_tpot": e["median_tpot_ms"] / b["median_tpot_ms"] if b["median_tpot_ms"] else None,
        "ttft_speedup": b["median_ttft_ms"] / e["median_ttft_ms"],
    }


def routing_of(label: str, workload: str, table: dict) -> str:
    """How a comparison row's elastic requests were routed, in words."""
    force = table.get(workload, {}).get("force")
    return f"{force} requests" if force else PAIRS[label][2]


def compare(results: dict, table: dict) -> list[dict]:
    """Rows elastic / baseline for every (workload, burst) both servers of a PAIRS entry ran."""
    rows = []
    for pair, (bkey, ekey, _) in PAIRS.items():
        base, el = results.get(bkey), results.get(ekey)
        if not base or not el:
            continue
        for wname, runs in el["runs"].items():
            bw = table[wname].get("base", wname)
            for burst, r in runs.items():
                br = base["runs"].get(bw, {}).get(burst)
                if "summary" not in r or not br or "summary" not in br:
                    continue
                row = {"model": pair, "routing": routing_of(pair, wname, table), "workload": wname, "burst": burst, "baseline_row": bw,
                       **{k: round(v, 3) if v is not None else None for k, v in ratios(br, r).items()},
                       "jit_elastic": len(r["jit"]), "jit_baseline": len(br["jit"])}  # fmt: skip
                # mean ms per request in vLLM's queue and prefill phases, baseline then elastic
                for ph in ("queue", "prefill"):
                    if ph in br.get("phases", {}) and ph in r.get("phases", {}):
                        row[f"{ph}_ms"] = [br["phases"][ph], r["phases"][ph]]
                rows.append(row)
    return rows


# --- targets: ratios elastic / baseline of one run ---------------------------------------------------------
PARITY = (
    "throughput >= 1.00x, median TTFT <= 1.00x, p99 TTFT <= 1.05x, no JIT",
    lambda r: r["throughput"] >= 1.0 and r["median_ttft"] <= 1.0 and r["p99_ttft"] <= 1.05 and r["jit_elastic"] == 0,
    lambda r: f"{r['throughput']:.2f}x / {r['median_ttft']:.2f}x / {r['p99_ttft']:.2f}x, JIT {r['jit_elastic']}",
)


def _at_least(what: str, key: str, x: float) -> tuple:
    return f"{what} >= {x:.2f}x", lambda r: r[key] >= x, lambda r: f"{r[key]:.2f}x"


SPEED_AND_THROUGHPUT = (
    "TTFT speed and throughput >= 0.95x",
    lambda r: r["ttft_speedup"] >= 0.95 and r["throughput"] >= 0.95,
    lambda r: f"{r['ttft_speedup']:.2f}x / {r['throughput']:.2f}x",
)
ROUTED = ("llama", "llama, mixed 0.75", "llama, mixed 0.5")  # the Llama-shape rows that route (not all-FA)
# (comparison labels, workloads, bursts, (target in words, met?, measured in words))
TARGETS = (
    (ROUTED, ("1k", "8k"), ("cold", "warm"), PARITY),
    (("llama",), ("32k",), ("warm",), _at_least("throughput", "throughput", 1.35)),
    (("llama, mixed 0.75",), ("32k",), ("warm",), _at_least("throughput", "throughput", 1.30)),
    (("llama",), ("128k",), ("warm",), _at_least("TTFT speed", "ttft_speedup", 2.0)),
    (("llama, mixed 0.75",), ("128k",), ("warm",), _at_least("TTFT speed", "ttft_speedup", 1.8)),
    (("llama",), ("fa32k", "fa128k"), ("warm",), _at_least("TTFT speed", "ttft_speedup", 0.98)),
    (("demo",), ("demo", "chat"), ("warm",), SPEED_AND_THROUGHPUT),
)


# the rows a report of the committed runs shows, measured or not: (comparison labels, workloads), both bursts
REPORTED = (
    (ROUTED, ("1k", "8k", "32k", "128k")),
    (("llama",), ("fa32k", "fa128k")),
    (("demo",), ("demo", "chat")),
)


def target_of(model: str, workload: str, burst: str) -> tuple | None:
    """The target of a comparison row: (in words, met?(row), measured(row)), or None where there is none."""
    for models, workloads, bursts, t in TARGETS:
        if model in models and workload in workloads and burst in bursts:
            return t
    return None


def targets(rows: list[dict]) -> list[dict]:
    """Each row's target, met or not."""
    out = []
    for r in rows:
        t = target_of(r["model"], r["workload"], r["burst"])
        if t is not None:
            text, ok, value = t
            out.append({"model": r["model"], "workload": r["workload"], "burst": r["burst"],
                        "what": f"{r['model']} {r['workload']} {r['burst']}: {text}", "value": value(r),
                        "met": bool(ok(r))})  # fmt: skip
    return out


def markdown(d: dict) -> str:
    env = d["environment"]
    lines = [
        f"# Serving: elastic vs {d['baseline']} ({env.get('gpu')})",
        "",
        made_with(
            {"triton": "None", **env},
            d.get("merged_from", [])[1:],
            f"; report: `{env['report_command']}`" if env.get("report_command") else "",
        ),
        "",
        "Ratios elastic / baseline from one run (`vllm bench serve`, random prompts or `chat`'s, `--ignore-eos`); TTFT"
        " speed is baseline / elastic median TTFT.",
        "",
        "| model | routing | workload | burst | throughput | median TTFT | p99 TTFT | median TPOT | TTFT speed "
        "| JIT (elastic) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["comparison"]:
        tpot = f"{r['median_tpot']:.2f}x" if r["median_tpot"] is not None else "-"
        routing = r.get("routing") or routing_of(r["model"], r["workload"], WORKLOADS)
        lines.append(
            f"| {r['model']} | {routing} | {r['workload']} | {r['burst']} | {r['throughput']:.2f}x | {r['median_ttft']:.2f}x | "
            f"{r['p99_ttft']:.2f}x | {tpot} | {r['ttft_speedup']:.2f}x | {r['jit_elastic']} |"
        )
    split = [r for r in d["comparison"] if "queue_ms" in r and "prefill_ms" in r]
    if split:
        lines += ["", "Where TTFT goes (vLLM's `request_queue_time` / `request_prefill_time` histograms, mean ms per"
                  " request, baseline -> elastic):", "", "| model | workload | burst | queued | prefill |",
                  "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['model']} | {r['workload']} | {r['burst']} | {r['queue_ms'][0]:.0f} -> {r['queue_ms'][1]:.0f} "
                  f"| {r['prefill_ms'][0]:.0f} -> {r['prefill_ms'][1]:.0f} |" for r in split]  # fmt: skip
    if d["targets"]:
        lines += ["", "| target | measured | |", "|---|---|---|"]
        lines += [f"| {t['what']} | {t['value']} | {'met' if t['met'] else 'not met'} |" for t in d["targets"]]
    return "\n".join(lines) + "\n"


def server_env(cuda: bool) -> tuple[dict, list[str]]:
    """The servers' environment (offline, no usage stats) and the arguments every server gets: none on the GPU
    (vLLM's serving defaults); on the CPU float32, eager and 256 tokens a step."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", VLLM_USE_FLASHINFER_SAMPLER="0")  # fmt: skip
    # vLLM's benchmark client keeps idle connections 60 s (aiohttp keepalive_timeout), its server closes them after
    # 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request sent on a connection the server is closing fails in the client
    # (ServerDisconnectedError) without reaching the engine. The server outlasting the client removes that race
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "75")
    common: list[str] = []
    if not cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # float32 and eager: bf16 matmuls and torch.compile take minutes on a 2-core CPU
        common = ["--dtype", "float32", "--max-num-batched-tokens", "256", "--enforce-eager"]
    return env, common


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--demo-model", type=Path, help="the demo model folder (default: elastic_vllm.models.fetch_demo_model)"
    )
    p.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument(
        "--servers",
        default="llama-base,llama-elastic,demo-base,demo-elastic",
        help="also llama-elastic-kernels: elastic with ELASTIC_VLLM_FLASH_DENSE=off (the dispatch's A/B)",
    )
    p.add_argument("--baseline", default=None, help="the baseline backend (default FLASH_ATTN on CUDA, CPU_ATTN else)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve-vs-flash-attn-h200.json")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        default=[],
        help="earlier --out files to keep; a later file's runs replace an earlier one's (server, workload)",
    )
    p.add_argument("--report", action="store_true", help="run nothing: compare the --merge files and write --out")
    p.add_argument("--dry", action="store_true", help="CPU plumbing check: tiny shapes")
    p.add_argument(
        "--max-model-len", type=int, default=None,
        help="the Llama-shape servers' (default: the longest workload asked for); compared runs of separate calls"
        " need the same",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.report:  # nothing runs: no torch import (the baseline is the merged files')
        cuda = False
    else:
        import torch

        cuda = torch.cuda.is_available()
    table = DRY if a.dry else WORKLOADS
    names = [w for w in (a.workloads.split(",") if a.workloads else table) if w in table]
    baseline = a.baseline or ("FLASH_ATTN" if cuda else "CPU_ATTN")
    if a.demo_model is None and not a.report:
        from elastic_vllm.models import fetch_demo_model

        a.demo_model = fetch_demo_model()
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    env, common = server_env(cuda)
    llama_names = [w for w in names if table[w]["model"] == "llama"]
    demo_names = [w for w in names if table[w]["model"] == "demo"]
    mml = a.max_model_len or max([table[w]["input"] + table[w]["output"] for w in llama_names] or [1024])
    el_llama: dict = {}  # server -> its elastic config
    servers: dict = {}
    el_demo = dict(DEMO_ELASTIC)
    if not a.report:
        llama = llama_dir(work, a.demo_model, mml, a.dry)
        llama_args = ["--load-format", "dummy", "--max-model-len", str(mml)]
        servers["llama-base"] = (llama, "llama", baseline, llama_args, llama_names)
        for label, (within, share) in LLAMA_ROUTERS.items():
            el_llama[label] = {"router_path": str(fixed_share_router(llama, work, share, within))}
            cfg = json.dumps({"elastic": el_llama[label]})
            servers[label] = (llama, "llama", "elastic", [*llama_args, "--additional-config", cfg], llama_names)
        servers["demo-base"] = (a.demo_model, "demo", baseline, [], demo_names)
        servers["demo-elastic"] = (a.demo_model, "demo", "elastic",
                                   ["--additional-config", json.dumps({"elastic": el_demo})], demo_names)  # fmt: skip
    results: dict = {}
    merged_from = []
    for path in a.merge:
        d0 = json.loads(path.read_text())
        merged_from.append({"file": path.name, "command": d0["environment"]["command"],
                            "git_commit": d0["environment"]["git_commit"]})  # fmt: skip
        for label, rec in d0["servers"].items():
            if label in results:
                results[label]["runs"].update(rec["runs"])
            else:
                results[label] = rec
    cmd = ["python3", "benchmarks/serve_bench.py", *argv]
    # --report runs nothing: its record is the command (the runs' machine and versions come from their files)
    env_rec = provenance(cmd) if a.report else environment(("torch", "triton", "vllm", "transformers"), cmd)
    if a.report and a.merge:  # the machine and versions are the runs', the command is this report's
        first = json.loads(a.merge[0].read_text())
        baseline = first["baseline"]
        env_rec = {**first["environment"], "report_command": env_rec["command"]}
    config = {label: {**c, "router": "fixed share {1} within {0} (benchmarks/_routers.py)".format(*LLAMA_ROUTERS[label])}
              for label, c in el_llama.items()}  # fmt: skip
    config["demo-elastic"] = el_demo

    def write() -> dict:
        rows = compare(results, table)
        d = {
            "benchmark": "serve_bench",
            "environment": env_rec,
            "baseline": baseline,
            "max_model_len": mml if llama_names else None,
            "workloads": {w: table[w] for w in names},
            "elastic_config": config,
            "comparison": rows,
            "targets": targets(rows) if not a.dry else [],
            "servers": results,
            "merged_from": merged_from,
        }
        write_json(a.out, d)
        a.out.with_suffix(".md").write_text(markdown(d))
        return d

    for label in [] if a.report else a.servers.split(","):
        if label not in servers:
            raise SystemExit(f"--servers: unknown server {label!r} (one of {', '.join(servers)})")
        model, name, backend, args, wl = servers[label]
        # all-FA requests (overrides are elastic's) run on one elastic server, compared with the baseline's row of
        # the same shape: the router is not consulted, so the other routers' servers would repeat them
        wl = [w for w in wl if not table[w].get("force") or label == FORCED_ON]
        if not wl:
            continue
        earlier = results.get(label, {}).get("runs", {})

        def save(rec, label=label, earlier=earlier):  # this run's workloads replace a merged file's, others stay
            results[label] = {**rec, "runs": {**earlier, **rec["runs"]}}
            write()

        serve_and_run(label, model, name, backend, [*common, *args], wl, table, work, env, startup_s=900, save=save)
    d = write()
    print(markdown(d))
    errors = [k for k, v in results.items() if v.get("error")]
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
