"""PNG figures of an accuracy run (matplotlib, Agg backend): Pareto, per-task Omega_MSR, FA-frequency heat map."""

from __future__ import annotations

from pathlib import Path

from elastic_vllm.eval.ruler import RULER_TASKS

ROBUST = ("summ", "cont", "code")
MARKERS = {
    "dense": "s",
    "elastic": "o",
    "elastic-sparse": "P",
    "static": "D",
    "all-SA": "X",
    "FA-XA": "^",
    "XA-SSA": "v",
}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, dpi: int = 120) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def replot(plot, name: str) -> None:
    """``python3 -m elastic_vllm.eval.<suite> RESULTS.json``: the suite's figure redrawn beside its results."""
    import json
    import sys

    results = Path(sys.argv[1])
    print(plot(json.loads(results.read_text()), results.parent / name))


def pareto(res: dict, path: Path) -> Path:
    """Task-macro score vs Omega_ESR, one point per method and length; sensitive and robust panels."""
    plt = pyplot()
    t = res["table"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lengths = sorted({int(n) for m in t.values() for n in m})
    for ax, key, title in (
        (axes[0], "ruler_avg", "RULER (sparsity-sensitive)"),
        (axes[1], "robust_avg", "robust tasks"),
    ):
        for i, m in enumerate(t):
            for j, n in enumerate(lengths):
                c = t[m].get(str(n), {}).get(key)
                if c is None:
                    continue
                ax.scatter(
                    c["omega_esr"],
                    c["score"],
                    marker=MARKERS.get(m, "o"),
                    s=70 if j == len(lengths) - 1 else 40,
                    color=f"C{i}",
                    alpha=1.0 if j == len(lengths) - 1 else 0.55,
                    label=f"{m} @{n}",
                )
        ax.set_xlabel("Omega_ESR (pruned share of causal attention pairs)")
        ax.set_ylabel("score (0-100)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2, loc="best")
    fig.suptitle("Accuracy vs effective sparsity (faded markers: shorter length)")
    return save(fig, path)


def per_task_msr(res: dict, path: Path) -> Path:
    """Realized Omega_MSR per task (bars) for the router-driven methods, one panel per length."""
    plt = pyplot()
    t = res["table"]
    routed = [m for m in ("elastic", "elastic-sparse", "FA-XA", "XA-SSA", "static") if m in t]
    lengths = sorted({int(n) for m in t.values() for n in m}, reverse=True)
    tasks = [x for x in (*RULER_TASKS, *ROBUST) if any(x in t[m].get(str(n), {}) for m in routed for n in lengths)]
    fig, axes = plt.subplots(len(lengths), 1, figsize=(max(8, 0.6 * len(tasks) + 2), 3.2 * len(lengths)), squeeze=False)
    width = 0.8 / max(len(routed), 1)
    for ax, n in zip(axes[:, 0], lengths):
        for i, m in enumerate(routed):
            xs, ys = [], []
            for k, task in enumerate(tasks):
                c = t[m].get(str(n), {}).get(task)
                if c is not None:
                    xs.append(k + (i - (len(routed) - 1) / 2) * width)
                    ys.append(c["omega_msr"])
            ax.bar(xs, ys, width=width, label=m, color=f"C{list(t).index(m)}")
        if any(x in tasks for x in ROBUST):
            ax.axvline(len([x for x in tasks if x in RULER_TASKS]) - 0.5, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels(tasks, rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_ylabel("Omega_MSR")
        ax.set_title(f"realized Omega_MSR per task at {n} tokens (left: sensitive, right: robust)")
        ax.legend(fontsize=7)
    return save(fig, path)


def heatmap(res: dict, path: Path, method: str = "elastic") -> Path | None:
    """Per-(layer, KV head) FA frequency of ``method`` on sensitive vs robust prompts (the paper's Figure 6),
    plus the static hybrid's retrieval scores when present."""
    import numpy as np

    plt = pyplot()
    freq = res.get("fa_frequency", {}).get(method)
    if not freq:
        return None
    n = str(max(int(x) for x in freq))
    panels = [
        (f"{method}: FA frequency, {cat} @{n}", np.array(freq[n][cat]))
        for cat in ("sensitive", "robust")
        if cat in freq[n]
    ]
    scores = res.get("static_hybrid", {}).get("retrieval_scores")
    if scores is not None:
        panels.append(("retrieval score (needle attention mass, dense)", np.array(scores)))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(10, 1.2 + 1.1 * len(panels) * max(1, panels[0][1].shape[1] / 4)), squeeze=False
    )
    for ax, (title, a) in zip(axes[:, 0], panels):
        im = ax.imshow(a.T, aspect="auto", cmap="viridis", vmin=0, vmax=1 if "FA" in title else None)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("KV head")
        ax.set_yticks(range(a.shape[1]))
        fig.colorbar(im, ax=ax, fraction=0.03)
    axes[-1, 0].set_xlabel("layer")
    axes[-1, 0].set_xticks(range(panels[0][1].shape[0]))
    return save(fig, path)


def write_plots(res: dict, out: Path) -> list[str]:
    """All figures of one run into ``out``; returns their file names."""
    out = Path(out)
    made = [pareto(res, out / "pareto.png"), per_task_msr(res, out / "msr_per_task.png")]
    h = heatmap(res, out / "fa_heatmap.png")
    if h is not None:
        made.append(h)
    return [p.name for p in made]


def main(argv: list[str] | None = None) -> int:
    """``python3 -m elastic_vllm.eval.plots RESULTS.json [OUT_DIR]``: redraw the figures of a finished run."""
    import json
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(main.__doc__)
        return 2
    path = Path(argv[0])
    res = json.loads(path.read_text())
    out = Path(argv[1]) if len(argv) > 1 else path.parent
    res["plots"] = write_plots(res, out)
    if len(argv) == 1:
        path.write_text(json.dumps(res, indent=1) + "\n")
    print(" ".join(res["plots"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
