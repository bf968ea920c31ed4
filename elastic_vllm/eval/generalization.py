"""The generalization suite: held-out task families, per family, Elastic vs dense vs the static hybrid.

Why one file of ~440 lines: the suite's run, aggregation per family, margin trade-off and report read one table.

    elastic-vllm eval --suite generalization-split --model DIR --router DIR --out OUT [--device cuda]

Reads the generalization split (``build-data --generalization N``; the demo model's is committed as
elastic_vllm/eval/data/smollm2_generalization.jsonl.gz): samples of the haystack/form families that no
training sample has (``train.families.HELD_OUT``), sensitive and robust. For every (family, category)
cell it reports

- dense: every head FA (the reference);
- elastic: the router's own routing, realized Omega_MSR and score;
- static: the retrieval-ranked static hybrid (``baselines.static_routing``) at the Omega_MSR that
  Elastic realized on that very cell (same sparsity, fixed heads), from the static-hybrid calibration
  prompts of the accuracy data (its ``calib`` rows);

scores 0-100: sensitive = RULER's string_match_all over the answer's values (``, ``-separated: every
value of a multi-needle, every variable of a variable-tracking sample); robust = ROUGE-L of the
prediction against the dense model's own prediction (as the accuracy harness scores summaries).
Writes results.json (with the command, versions and commit), results.md, samples.jsonl.gz and
generalization.png (per family: score relative to dense and Omega_MSR).

Targets (the issue's, held-out families, demo model): every sensitive family keeps >= 95% of dense at
Omega_MSR <= 0.4; every robust family reaches Omega_MSR >= 0.8. The report says which cells miss and by
how much.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from elastic_vllm.eval import metrics as M
from elastic_vllm.eval.engine import DATA_DIR, METHODS, HFEngine, Method, base_config, finite_mean, provenance
from elastic_vllm.models import sha256_file

GEN_DATA = DATA_DIR / "smollm2_generalization.jsonl.gz"
CALIB_DATA = DATA_DIR / "smollm2_ruler.jsonl.xz"
CATEGORIES = ("sensitive", "robust")
TARGET_KEEP, TARGET_SENSITIVE_MSR, TARGET_ROBUST_MSR = 0.95, 0.4, 0.8


def load_rows(path: str | Path, per_cell: int, max_tokens: int | None = None) -> list[dict]:
    """At most ``per_cell`` rows of each (family, category), in file order; none longer than ``max_tokens``."""
    from elastic_vllm.train.data import read_jsonl

    seen: dict = defaultdict(int)
    out = []
    for r in read_jsonl(path):
        if "family" not in r:
            raise ValueError(
                f"{path}: row without 'family' (not a generalization split; see build-data --generalization)"
            )
        k = (r["family"], r["category"])
        if max_tokens is not None and r["tokens"] > max_tokens:
            continue
        if seen[k] < per_cell:
            r = dict(r, index=seen[k])
            seen[k] += 1
            out.append(r)
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def score(row: dict, pred: str, dense_pred: str | None) -> float:
    if row["category"] == "sensitive":
        return M.string_match_all(M.postprocess_pred(pred), [x for x in row["answer"].split(", ") if x])
    return M.rouge_l(pred, dense_pred) if dense_pred is not None else float("nan")


def _calib_rows(paths: list[str], n: int) -> list[dict]:
    from elastic_vllm.eval.ruler import read_jsonl

    rows = []
    for p in paths:
        rows += [r for r in read_jsonl(p) if r["task"] == "calib"]
    rows.sort(key=lambda r: (r["length"], r["index"]))
    return rows[:n]


def _batches(rows: list[dict], batch_tokens: int) -> list[list[dict]]:
    rows = sorted(rows, key=lambda r: (r["tokens"], r["index"]))
    out: list[list[dict]] = []
    for r in rows:
        cap = max(1, batch_tokens // max(r["tokens"], 1))
        if out and len(out[-1]) < cap:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def run_method(engine: HFEngine, method: Method, rows: list[dict], texts: dict, opts, static=None) -> list[dict]:
    engine.use(method, static)
    res = []
    for batch in _batches(rows, opts.batch_tokens):
        cap = opts.max_new_tokens if batch[0]["category"] == "sensitive" else opts.max_new_tokens_robust
        preds, routes = engine.generate([texts[id(r)] for r in batch], cap)
        for r, pred, route in zip(batch, preds, routes):
            res.append(
                {
                    "method": method.name,
                    "family": r["family"],
                    "category": r["category"],
                    "kind": r.get("kind"),
                    "template": r.get("template"),
                    "index": r["index"],
                    "prompt_tokens": r["tokens"],
                    "omega_msr": route["omega_msr"],
                    "pred": pred,
                }
            )
    return res


def aggregate(samples: list[dict]) -> dict:
    """table[family][category][method] = {n, score, omega_msr} (+ keep = score / dense score)."""
    groups: dict = defaultdict(list)
    for s in samples:
        groups[(s["family"], s["category"], s["method"])].append(s)
    table: dict = defaultdict(lambda: defaultdict(dict))
    for (fam, cat, m), xs in sorted(groups.items()):
        table[fam][cat][m] = {
            "n": len(xs),
            "score": finite_mean([x["score"] for x in xs]),
            "omega_msr": finite_mean([x["omega_msr"] for x in xs]),
        }
    for cells in table.values():
        for by_m in cells.values():
            d = by_m.get("dense", {}).get("score")
            for c in by_m.values():
                c["keep"] = c["score"] / d if d else float("nan")
    return json.loads(json.dumps(table))


def check_targets(table: dict, method: str = "elastic") -> list[dict]:
    out = []
    for fam, cells in sorted(table.items()):
        for cat, by_m in sorted(cells.items()):
            e = by_m.get(method)
            if e is None:
                continue
            if cat == "sensitive":
                ok_keep = e["keep"] >= TARGET_KEEP if not math.isnan(e["keep"]) else True
                ok = ok_keep and e["omega_msr"] <= TARGET_SENSITIVE_MSR
                miss = []
                if not ok_keep:
                    miss.append(f"keep {100 * e['keep']:.0f}% < {100 * TARGET_KEEP:.0f}%")
                if e["omega_msr"] > TARGET_SENSITIVE_MSR:
                    miss.append(
                        f"Omega_MSR {e['omega_msr']:.2f} > {TARGET_SENSITIVE_MSR} by {e['omega_msr'] - TARGET_SENSITIVE_MSR:.2f}"
                    )
            else:
                ok = e["omega_msr"] >= TARGET_ROBUST_MSR
                miss = (
                    []
                    if ok
                    else [
                        f"Omega_MSR {e['omega_msr']:.2f} < {TARGET_ROBUST_MSR} by {TARGET_ROBUST_MSR - e['omega_msr']:.2f}"
                    ]
                )
            out.append({"family": fam, "category": cat, "method": method, "met": bool(ok), "miss": "; ".join(miss)})
    return out


def open_split_run(opts, suite: str) -> tuple:
    """What the transformers suites on the split share before their engine starts: the router check, ``--quick``,
    the batch and dtype defaults, the base configuration and the rows. Returns (device, dtype, data path,
    base config, router meta, rows)."""
    device = torch.device(opts.device)
    if not opts.router:
        raise ValueError(f"--suite {suite} needs the trained router (--router DIR)")
    data = Path(opts.gen_data or GEN_DATA)
    if opts.quick:
        opts.samples, opts.calib_samples = 1, 1
        opts.max_new_tokens = opts.max_new_tokens_robust = 8
    if opts.batch_tokens is None:
        opts.batch_tokens = 163840 if device.type == "cuda" else 16384
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    base_cfg, router_meta = base_config(opts.router, opts.sink, opts.window, getattr(opts, "sa_margin", None))
    rows = load_rows(data, opts.samples, getattr(opts, "gen_max_tokens", None))
    return device, dtype, data, base_cfg, router_meta, rows


def split_result_head(kind: str, suite: str, opts, argv, device, engine, data: Path, skipped: list) -> dict:
    """The first keys of both split suites' results.json: what ran, on what, from which data."""
    return {
        "kind": f"elastic-vllm {kind}",
        "complete": not skipped,
        "provenance": provenance(argv or ["elastic-vllm", "eval", "--suite", suite], device),
        "model": str(opts.model),
        "router": str(opts.router),
        "config": engine.base_cfg.model_dump(),
        "data": {
            "path": str(data),
            "sha256": sha256_file(data),
            "per_cell": opts.samples,
            "max_tokens": getattr(opts, "gen_max_tokens", None),
        },
    }


def run(opts, argv: list[str] | None = None, log=print) -> dict:
    t_start = time.perf_counter()
    device, dtype, data, base_cfg, router_meta, rows = open_split_run(opts, "generalization-split")
    log(f"generalization: {len(rows)} prompts from {data} on {device} {dtype}")
    engine = HFEngine(opts.model, base_cfg, opts.router, dtype, device, opts.impl)
    from elastic_vllm.train.data import prompt_text

    texts = {id(r): prompt_text(r, engine.tok) for r in rows}
    samples: list[dict] = []
    dense: dict = {}
    skipped: list[str] = []

    def add(res: list[dict]) -> None:
        for s, r in zip(res, (by_key[(x["family"], x["category"], x["index"])] for x in res)):
            key = (s["family"], s["category"], s["index"])
            if s["method"] == "dense":
                dense[key] = s["pred"]
            s["score"] = score(r, s["pred"], dense.get(key))
            s["pred"] = s["pred"][:300]
        samples.extend(res)

    by_key = {(r["family"], r["category"], r["index"]): r for r in rows}
    elastic = Method("elastic", dict(METHODS["elastic"].cfg), True, label="Elastic FA-SSA")
    for m in (METHODS["dense"], elastic):
        t0 = time.perf_counter()
        add(run_method(engine, m, rows, texts, opts))
        log(f"[{time.perf_counter() - t_start:6.1f}s] {m.name}: {len(rows)} prompts ({time.perf_counter() - t0:.1f} s)")

    for margin in getattr(opts, "margins", None) or []:
        if opts.time_budget and time.perf_counter() - t_start > opts.time_budget:
            skipped.append(f"elastic@{margin:g}")
            continue
        m = Method(
            f"elastic@{margin:g}", {**elastic.cfg, "sa_margin": margin}, True, label=f"Elastic, sa_margin {margin:g}"
        )
        t0 = time.perf_counter()
        add(run_method(engine, m, rows, texts, opts))
        log(f"[{time.perf_counter() - t_start:6.1f}s] {m.name}: {len(rows)} prompts ({time.perf_counter() - t0:.1f} s)")

    static_info: dict = {"retrieval_scores": None, "omega_by_cell": {}}
    if not opts.no_static:
        from elastic_vllm.eval.baselines import retrieval_scores, static_routing

        calib = _calib_rows(opts.data, opts.calib_samples)
        if not calib:
            raise ValueError(f"the static hybrid needs calibration rows (task 'calib') in --data {opts.data}")
        engine.use(METHODS["dense"])
        scores = retrieval_scores(engine.model, engine.tok, calib, device)
        static_info["retrieval_scores"] = scores.tolist()
        static = Method("static", dict(METHODS["static"].cfg), False, static=True, label="static hybrid")
        cells = sorted({(r["family"], r["category"]) for r in rows})
        for fam, cat in cells:
            if opts.time_budget and time.perf_counter() - t_start > opts.time_budget:
                skipped.append(f"static/{fam}/{cat}")
                continue
            mine = [
                s["omega_msr"]
                for s in samples
                if s["method"] == "elastic" and (s["family"], s["category"]) == (fam, cat)
            ]
            omega = sum(mine) / len(mine)
            static_info["omega_by_cell"][f"{fam}|{cat}"] = omega
            cell_rows = [r for r in rows if (r["family"], r["category"]) == (fam, cat)]
            add(run_method(engine, static, cell_rows, texts, opts, static_routing(scores, omega)))
        log(f"[{time.perf_counter() - t_start:6.1f}s] static hybrid on {len(cells)} cells")

    table = aggregate(samples)
    res = {
        **split_result_head("generalization", "generalization-split", opts, argv, device, engine, data, skipped),
        "router_meta": router_meta,
        "held_out_families": sorted(table),
        "static_hybrid": static_info,
        "table": table,
        "summary": summary(table),
        "targets": check_targets(table),
        "margins": margin_tradeoff(table, base_cfg.sa_margin, getattr(opts, "margins", None) or []),
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    return write_outputs(res, samples, Path(opts.out), plot, "generalization", markdown, log)


def write_outputs(res: dict, samples: list[dict], out: Path, plot_fn, name: str, markdown_fn, log) -> dict:
    """samples.jsonl.gz, ``name``.png (``plot_fn``), results.json and results.md (``markdown_fn``) of a suite run."""
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "samples.jsonl.gz", "wt", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    try:
        res["plots"] = [str(plot_fn(res, out / f"{name}.png"))]
    except ImportError as e:  # the GPU image may lack matplotlib: plot later from results.json
        res["plots"] = f"not written ({e}); run: python3 -m elastic_vllm.eval.{name} {out / 'results.json'}"
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown_fn(res))
    log(markdown_fn(res))
    return res


def summary(table: dict) -> dict:
    """Per category, family-macro averages of every method: score, keep (vs dense), Omega_MSR."""
    out: dict = {}
    for cat in CATEGORIES:
        by_m: dict = defaultdict(list)
        for cells in table.values():
            for m, c in cells.get(cat, {}).items():
                by_m[m].append(c)
        out[cat] = {
            m: {k: finite_mean([c[k] for c in cs]) for k in ("score", "keep", "omega_msr")} | {"families": len(cs)}
            for m, cs in by_m.items()
        }
    return out


def margin_tradeoff(table: dict, base: float, margins: list[float]) -> list[dict]:
    """Per sa_margin (the base run's and every --margins one): family-macro sensitive keep and Omega_MSR,
    robust Omega_MSR and keep, and how many of the issue's per-family targets it meets."""
    out = []
    runs = [("elastic", base)] + [(f"elastic@{m:g}", m) for m in margins]
    for name, margin in runs:
        cells: dict = {cat: [] for cat in CATEGORIES}
        for fam in table.values():
            for cat, by_m in fam.items():
                if name in by_m:
                    cells[cat].append(by_m[name])
        if not any(cells.values()):
            continue
        targets = check_targets(table, name)
        out.append(
            {
                "method": name,
                "sa_margin": margin,
                "sensitive_keep": finite_mean([c["keep"] for c in cells["sensitive"]]),
                "sensitive_omega_msr": finite_mean([c["omega_msr"] for c in cells["sensitive"]]),
                "robust_keep": finite_mean([c["keep"] for c in cells["robust"]]),
                "robust_omega_msr": finite_mean([c["omega_msr"] for c in cells["robust"]]),
                "targets_met": sum(x["met"] for x in targets),
                "targets": len(targets),
            }
        )
    return out


def _f(x, nd=1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(res: dict) -> str:
    t = res["table"]
    p = res["provenance"]
    methods = [m for m in ("dense", "elastic", "static") if any(m in c for f in t.values() for c in f.values())]
    lines = [
        "# Generalization: held-out task families",
        "",
        f"Model `{res['model']}`, router `{res['router']}`; {p['gpu']}, torch {p['torch']}, transformers "
        f"{p['transformers']}, commit {p['git_commit'][:12]}. Command: `{p['command']}`",
        "",
        "Cells: score (0-100) / Omega_MSR, mean over n samples; static = the retrieval-ranked static hybrid at "
        "Elastic's realized Omega_MSR of the same cell. keep = elastic score / dense score.",
        "",
        "| family | category | n | " + " | ".join(methods) + " | keep | target |",
        "|---|---|---|" + "---|" * len(methods) + "---|---|",
    ]
    tgt = {(x["family"], x["category"]): x for x in res["targets"]}
    for fam, cells in sorted(t.items()):
        for cat in CATEGORIES:
            if cat not in cells:
                continue
            c = cells[cat]
            row = [f"{_f(c[m]['score'])} / {_f(c[m]['omega_msr'], 2)}" if m in c else "-" for m in methods]
            x = tgt.get((fam, cat))
            verdict = "-" if x is None else ("met" if x["met"] else f"MISSED: {x['miss']}")
            keep = c.get("elastic", {}).get("keep")
            n = c.get("dense", {}).get("n", 0)
            lines.append(
                f"| {fam} | {cat} | {n} | "
                + " | ".join(row)
                + f" | {_f(100 * keep if keep is not None else None, 0)}% | {verdict} |"
            )
    lines += ["", "Family-macro averages (score / keep vs dense / Omega_MSR):", ""]
    for cat, by_m in res["summary"].items():
        parts = [f"{m} {_f(v['score'])} / {_f(100 * v['keep'], 0)}% / {_f(v['omega_msr'], 2)}" for m, v in by_m.items()]
        lines.append(f"- {cat}: " + "; ".join(parts))
    if len(res.get("margins", [])) > 1:
        lines += [
            "",
            "sa_margin trade-off (family-macro; keep = score / dense score):",
            "",
            "| sa_margin | sensitive keep | sensitive Omega_MSR | robust keep | robust Omega_MSR | targets met |",
            "|---|---|---|---|---|---|",
        ]
        for x in res["margins"]:
            lines.append(
                f"| {x['sa_margin']:g} | {_f(100 * x['sensitive_keep'], 0)}% | {_f(x['sensitive_omega_msr'], 2)} | "
                f"{_f(100 * x['robust_keep'], 0)}% | {_f(x['robust_omega_msr'], 2)} | {x['targets_met']} / {x['targets']} |"
            )
    met = sum(x["met"] for x in res["targets"])
    lines += ["", f"Targets met in {met} of {len(res['targets'])} cells; wall {res['wall_s']} s."]
    if res["skipped"]:
        lines.append(f"Skipped (time budget): {', '.join(res['skipped'])}")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> Path:
    """Per held-out family: score relative to dense (bars, elastic and static) and Elastic's Omega_MSR (dots)."""
    from elastic_vllm.eval.plots import pyplot, save

    plt = pyplot()

    t = res["table"]
    fams = sorted(t)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, cat in zip(axes, CATEGORIES):
        x = list(range(len(fams)))
        for k, (m, color) in enumerate((("elastic", "tab:blue"), ("static", "tab:orange"))):
            ys = [100 * t[f].get(cat, {}).get(m, {}).get("keep", float("nan")) for f in fams]
            ax.bar([i + (k - 0.5) * 0.38 for i in x], ys, width=0.38, color=color, label=f"{m}: score % of dense")
        om = [100 * t[f].get(cat, {}).get("elastic", {}).get("omega_msr", float("nan")) for f in fams]
        ax.plot(x, om, "kD", label="elastic Omega_MSR (%)")
        goal = TARGET_SENSITIVE_MSR if cat == "sensitive" else TARGET_ROBUST_MSR
        ax.axhline(100 * goal, color="k", ls=":", lw=1, label=f"Omega_MSR target {goal}")
        if cat == "sensitive":
            ax.axhline(100 * TARGET_KEEP, color="tab:red", ls="--", lw=1, label="95% of dense")
        ax.set_xticks(x, fams, rotation=30, ha="right")
        ax.set_title(f"{cat} (held-out families)")
        ax.set_ylim(0, 130)
    axes[0].set_ylabel("%")
    axes[1].legend(fontsize=7, loc="upper right")
    return save(fig, path, dpi=110)


if __name__ == "__main__":  # re-plot from a results.json
    from elastic_vllm.eval.plots import replot

    replot(plot, "generalization.png")
