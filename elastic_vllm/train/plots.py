"""PNG curves of a router-training log (matplotlib, the [train] extra).

One figure per quantity, each one PNG: lm_loss, reg_loss, omega_msr (per task; argmax decisions,
i.e. what inference would do), gap (|Omega - t| per category), lambdas (per category), tau; and
curves.png with all six panels.
Per-task curves are smoothed with an EMA (a step only holds a few sequences of each task).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _ema(xs: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else (1 - alpha) * m + alpha * x
        out.append(m)
    return out


def _series(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        for name, v in r.get(key, {}).items():
            s, y = out.setdefault(name, ([], []))
            s.append(r["step"])
            y.append(v)
    return out


def plot_log(records: list[dict], folder: str | Path) -> list[str]:
    """Write the PNGs; returns their paths ([] with a note on stderr when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'elastic-vllm[train]')", file=sys.stderr)
        return []
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []

    def save(fig, name):
        fig.tight_layout()
        p = out / f"{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))

    for key, label in (("lm_loss", "LM loss (answer tokens)"), ("reg_loss", "sparsity regularisation loss")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ys = [r[key] for r in records]
        ax.plot(steps, ys, alpha=0.3, color="C0")
        ax.plot(steps, _ema(ys), color="C0")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        save(fig, key)

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (task, (s, y)) in enumerate(sorted(_series(records, "omega_argmax").items())):
        ax.plot(s, _ema(y), label=task, color=f"C{i}")
    ax.set_xlabel("step")
    ax.set_ylabel("Omega_MSR (argmax routing, EMA)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    save(fig, "omega_msr")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (cat, (s, y)) in enumerate(sorted(_series(records, "gap").items())):
        ax.plot(s, _ema(y), label=cat, color=f"C{i}")
    ax.set_xlabel("step")
    ax.set_ylabel("|Omega - t| (EMA)")
    ax.legend()
    save(fig, "gap")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    cats = sorted(records[-1]["lambdas"]) if records else []
    for i, cat in enumerate(cats):
        for name, style in (("lambda1", "-"), ("lambda2", "--")):
            ax.plot(steps, [r["lambdas"][cat][name] for r in records], style, color=f"C{i}", label=f"{name} {cat}")
    ax.set_xlabel("step")
    ax.set_ylabel("Lagrange multiplier")
    ax.legend(fontsize=7)
    save(fig, "lambdas")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["tau"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("Gumbel temperature tau")
    save(fig, "tau")

    # everything in one figure, for a quick look (and transports that return few files)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    (a, b, c), (d, e, f) = axes
    for ax, key in ((a, "lm_loss"), (b, "reg_loss")):
        ys = [r[key] for r in records]
        ax.plot(steps, ys, alpha=0.3, color="C0")
        ax.plot(steps, _ema(ys), color="C0")
        ax.set_title(key)
    for i, (task, (s, y)) in enumerate(sorted(_series(records, "omega_argmax").items())):
        c.plot(s, _ema(y), label=task, color=f"C{i}")
    c.set_ylim(-0.02, 1.02)
    c.set_title("Omega_MSR per task (argmax, EMA)")
    c.legend(fontsize=7)
    for i, (cat, (s, y)) in enumerate(sorted(_series(records, "gap").items())):
        d.plot(s, _ema(y), label=cat, color=f"C{i}")
    d.set_title("|Omega - t| per category (EMA)")
    d.legend(fontsize=7)
    for i, cat in enumerate(cats):
        for name, style in (("lambda1", "-"), ("lambda2", "--")):
            e.plot(steps, [r["lambdas"][cat][name] for r in records], style, color=f"C{i}", label=f"{name} {cat}")
    e.set_title("Lagrange multipliers")
    e.legend(fontsize=7)
    f.plot(steps, [r["tau"] for r in records])
    f.set_title("tau")
    for ax in axes.flat:
        ax.set_xlabel("step")
    save(fig, "curves")
    return written
