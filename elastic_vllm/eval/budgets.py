"""The budgets suite: accuracy vs realized Omega_MSR at fixed SA budgets, for three ways of choosing the heads.

    elastic-vllm eval --suite budgets --model DIR --router DIR --out OUT [--targets 0.25 0.5 0.75 0.9] [--quick]

``--quick`` (a CPU smoke run): the 2 shortest prompts per category, 8 new tokens.

At each target t (a share of a request's (layer, KV head) pairs in SA; exactly round-half-up(t x L x H) of them,
spread over the layers by the cumulative per-layer budget of ``router.model.budget_sa_counts``):

- router: ``target_omega = t`` (what ``elastic_target_omega`` does when serving): in every layer the heads whose
  router margin z_FA - z_SA is lowest go SA, per prompt;
- static: the same per-layer counts, the heads of lowest retrieval score (``baselines.retrieval_scores`` on the
  calibration prompts of the accuracy data) for every prompt;
- random: the same per-layer counts, random heads per prompt (seeded).

The three differ only in which heads go SA, never in how many: the comparison isolates the router's ranking.
Prompts: the generalization split (held-out families, sensitive and robust; committed for the demo model),
scored as the generalization suite scores them (sensitive: every value of the answer found; robust: ROUGE-L
against the dense model's own answer). Writes results.json (command, versions, commit), results.md,
samples.jsonl.gz and budgets.png (score vs realized Omega_MSR, per category, one curve per method).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from elastic_vllm.eval.engine import METHODS, HFEngine, Method, finite_mean
from elastic_vllm.eval.generalization import (
    CATEGORIES,
    _batches,
    _calib_rows,
    open_split_run,
    score,
    split_result_head,
    write_outputs,
)
from elastic_vllm.router.model import budget_sa_counts

TARGETS = (0.25, 0.5, 0.75, 0.9)
KINDS = ("router", "static", "random")
QUICK_PER_CATEGORY = 2


def static_budget(scores: torch.Tensor, target: float) -> torch.Tensor:
    """bool [L, H] (True = FA): per layer, the ``budget_sa_counts`` heads of lowest retrieval score go SA (ties to
    the lower head index), so its count per layer is the router budget's."""
    L, H = scores.shape
    fa = torch.ones(L, H, dtype=torch.bool)
    for layer, n_sa in enumerate(budget_sa_counts(target, L, 0, 1, H)):
        fa[layer, torch.argsort(scores[layer].float(), stable=True)[:n_sa]] = False
    return fa


def random_budget(target: float, batch: int, L: int, H: int, gen: torch.Generator) -> torch.Tensor:
    """bool [B, L, H] (True = FA): per row and layer, ``budget_sa_counts`` random heads go SA."""
    fa = torch.ones(batch, L, H, dtype=torch.bool)
    counts = budget_sa_counts(target, L, 0, 1, H)
    for b in range(batch):
        for layer, n_sa in enumerate(counts):
            fa[b, layer, torch.randperm(H, generator=gen)[:n_sa]] = False
    return fa


def _run(engine: HFEngine, name: str, rows, texts, opts, cfg: dict, fixed=None, per_row=None) -> list[dict]:
    """Generate every row under one configuration; ``fixed`` [L, H] or ``per_row(batch size)`` [B, L, H]
    replaces the router's decisions (static / random heads)."""
    engine.use(Method(name, cfg, name != "dense"))
    out = []
    for batch in _batches(rows, opts.batch_tokens):
        routing = per_row(len(batch)) if per_row is not None else fixed
        engine.state.fixed_routing = None if routing is None else routing.to(engine.device)
        cap = opts.max_new_tokens if batch[0]["category"] == "sensitive" else opts.max_new_tokens_robust
        preds, routes = engine.generate([texts[id(r)] for r in batch], cap)
        for r, pred, route in zip(batch, preds, routes):
            out.append({"method": name, "family": r["family"], "category": r["category"], "index": r["index"],
                        "prompt_tokens": r["tokens"], "omega_msr": route["omega_msr"], "pred": pred})  # fmt: skip
    engine.state.fixed_routing = None
    return out


def run(opts, argv: list[str] | None = None, log=print) -> dict:
    t_start = time.perf_counter()
    targets = list(getattr(opts, "targets", None) or TARGETS)
    bad = [t for t in targets if not 0.0 <= t <= 1.0]
    if bad:
        raise ValueError(f"--targets must lie in [0, 1], got {bad}")
    device, dtype, data, base_cfg, router_meta, rows = open_split_run(opts, "budgets")
    if opts.quick:  # 2 + 3 x targets runs of every prompt: a CPU smoke run keeps the 2 shortest prompts per category
        short = sorted(rows, key=lambda r: (r["tokens"], r["family"]))
        rows = [r for cat in CATEGORIES for r in [x for x in short if x["category"] == cat][:QUICK_PER_CATEGORY]]
    log(f"budgets: {len(rows)} prompts from {data}, targets {targets}, on {device} {dtype}")
    engine = HFEngine(opts.model, base_cfg, opts.router, dtype, device, opts.impl)
    from elastic_vllm.eval.baselines import retrieval_scores
    from elastic_vllm.train.data import prompt_text

    texts = {id(r): prompt_text(r, engine.tok) for r in rows}
    by_key = {(r["family"], r["category"], r["index"]): r for r in rows}
    samples: list[dict] = []
    dense: dict = {}

    def add(res: list[dict]) -> None:
        for s in res:
            key = (s["family"], s["category"], s["index"])
            if s["method"] == "dense":
                dense[key] = s["pred"]
            s["score"] = score(by_key[key], s["pred"], dense.get(key))
            s["pred"] = s["pred"][:300]
        samples.extend(res)

    elastic_cfg = dict(METHODS["elastic"].cfg)
    add(_run(engine, "dense", rows, texts, opts, dict(METHODS["dense"].cfg)))
    add(_run(engine, "router", rows, texts, opts, elastic_cfg))  # the router alone: its own Omega_MSR
    calib = _calib_rows(opts.data, opts.calib_samples)
    if not calib:
        raise ValueError(f"the static ranking needs calibration rows (task 'calib') in --data {opts.data}")
    engine.use(METHODS["dense"])
    scores = retrieval_scores(engine.model, engine.tok, calib, device)
    L, H = scores.shape
    gen = torch.Generator().manual_seed(0)
    skipped = []
    for t in targets:
        for kind in KINDS:
            name = f"{kind}@{t:g}"
            if opts.time_budget and time.perf_counter() - t_start > opts.time_budget:
                skipped.append(name)
                continue
            t0 = time.perf_counter()
            if kind == "router":
                res = _run(engine, name, rows, texts, opts, {**elastic_cfg, "target_omega": t})
            elif kind == "static":
                res = _run(engine, name, rows, texts, opts, elastic_cfg, fixed=static_budget(scores, t))
            else:
                res = _run(engine, name, rows, texts, opts, elastic_cfg,
                           per_row=lambda b, t=t: random_budget(t, b, L, H, gen))  # fmt: skip
            add(res)
            now = time.perf_counter()
            log(f"[{now - t_start:6.1f}s] {name}: {len(rows)} prompts ({now - t0:.1f} s)")
    res = {
        **split_result_head("budgets", "budgets", opts, argv, device, engine, data, skipped),
        "router_meta": router_meta,
        "targets": targets,
        "retrieval_scores": scores.tolist(),
        "curves": curves(samples, targets),
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    return write_outputs(res, samples, Path(opts.out), plot, "budgets", markdown, log)


def curves(samples: list[dict], targets: list[float]) -> dict:
    """{category: {method: [{target, omega_msr, score, n}, ...]}}: means over the category's prompts; the router
    alone (no budget) is the point with target None, dense the point at Omega_MSR 0."""
    out: dict = {}
    for cat in CATEGORIES:
        mine = [s for s in samples if s["category"] == cat]
        if not mine:
            continue
        table: dict = {}
        series = [("dense", [("dense", None)]), ("router (own Omega)", [("router", None)])]
        series += [(kind, [(f"{kind}@{t:g}", t) for t in targets]) for kind in KINDS]
        for label, names in series:
            pts = []
            for name, t in names:
                got = [s for s in mine if s["method"] == name]
                if got:
                    pts.append({"target": t, "omega_msr": finite_mean(s["omega_msr"] for s in got),
                                "score": finite_mean(s["score"] for s in got), "n": len(got)})  # fmt: skip
            if pts:
                table[label] = pts
        out[cat] = table
    return out


def markdown(res: dict) -> str:
    lines = [f"# Budgets: accuracy vs realized Omega_MSR ({res['model']})", "",
             f"Router `{res['router']}`; data `{res['data']['path']}` ({res['data']['per_cell']} per family and "
             f"category); `{res['provenance']['command']}`", ""]  # fmt: skip
    for cat, table in res["curves"].items():
        lines += [f"## {cat}", "", "| method | target | realized Omega_MSR | score | n |", "|---|---|---|---|---|"]
        for method, pts in table.items():
            for p in pts:
                t = "-" if p["target"] is None else f"{p['target']:g}"
                lines.append(f"| {method} | {t} | {p['omega_msr']:.3f} | {p['score']:.1f} | {p['n']} |")
        lines.append("")
    if res["skipped"]:
        lines.append(f"Skipped (time budget): {', '.join(res['skipped'])}")
    lines.append(f"wall {res['wall_s']} s")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> Path:
    """Score vs realized Omega_MSR per category: one curve per head choice, dense and the router alone as points."""
    from elastic_vllm.eval.plots import pyplot, save

    plt = pyplot()

    cats = list(res["curves"])
    fig, axes = plt.subplots(1, max(1, len(cats)), figsize=(6 * max(1, len(cats)), 4.2), squeeze=False)
    style = {"router": "o-", "static": "s--", "random": "^:", "dense": "k*", "router (own Omega)": "bD"}
    for ax, cat in zip(axes[0], cats):
        for method, pts in res["curves"][cat].items():
            ax.plot([p["omega_msr"] for p in pts], [p["score"] for p in pts], style.get(method, "x-"), label=method)
        ax.set_xlabel("realized Omega_MSR")
        ax.set_ylabel("score (0-100)")
        ax.set_title(cat)
        ax.set_xlim(-0.02, 1.02)
    axes[0][-1].legend(fontsize=8)
    return save(fig, path, dpi=110)


if __name__ == "__main__":  # re-plot from a results.json
    from elastic_vllm.eval.plots import replot

    replot(plot, "budgets.png")
