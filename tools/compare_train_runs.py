#!/usr/bin/env python3
"""Compare two router-training runs of the same recipe (e.g. one GPU vs `torchrun` FSDP on two GPUs).

    python3 tools/compare_train_runs.py REF_DIR RUN_DIR --out compare.json [--world-ref 1 --world-run 2]

Each DIR holds the trainer's summary.json and train_log.jsonl (or .jsonl.gz) (gpu_train_smollm2.sh's output). Per step,
the two runs see the same samples and the same Gumbel noise (a function of seed, step and sample index),
so their curves differ only by floating-point reduction order and the chaos it seeds. "Within noise":

- LM loss: the 10-step moving averages differ by at most 2x the reference's own step-to-step noise
  (std of its loss minus its 10-step moving average) at every step;
- realized Omega_MSR per category (argmax, 10-step moving average): at most 0.05 apart at every step
  after the first 10, and the final held-out-free training values at most 0.05 apart;
- lambda1 per category: at most 0.1 + 10% of the reference's value apart at the end.

Throughput: tokens per second per GPU (the logged tokens are the step's total over all ranks), median
over the steps after the first 5.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
from pathlib import Path

CATS = ("robust", "sensitive")
MA = 10


def load(d: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((d / "summary.json").read_text())
    plain, packed = d / "train_log.jsonl", d / "train_log.jsonl.gz"  # committed logs are gzipped
    text = plain.read_text() if plain.is_file() else gzip.decompress(packed.read_bytes()).decode()
    log = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not log:
        raise SystemExit(f"{d}: train_log.jsonl is empty")
    return summary, log


def moving_avg(xs: list[float], n: int = MA) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def category_omega(rec: dict, categories: dict[str, str]) -> dict[str, float]:
    """Mean argmax Omega over the tasks of each category present in this step's log record."""
    by: dict[str, list[float]] = {}
    for task, v in rec["omega_argmax"].items():
        by.setdefault(categories.get(task, "?"), []).append(v)
    return {c: sum(v) / len(v) for c, v in by.items()}


def throughput(log: list[dict], world: int) -> dict:
    rows = log[5:] or log
    per = sorted(r["tokens"] / r["step_s"] / world for r in rows if r["step_s"] > 0)
    steps = sorted(r["step_s"] for r in rows)
    return {
        "tokens_per_s_per_gpu_median": round(per[len(per) // 2], 1),
        "step_s_median": round(steps[len(steps) // 2], 4),
        "tokens_per_step_mean": round(sum(r["tokens"] for r in rows) / len(rows), 1),
        "gpus": world,
    }


def compare(ref: tuple[dict, list[dict]], run: tuple[dict, list[dict]], categories: dict[str, str]) -> dict:
    (s_ref, l_ref), (s_run, l_run) = ref, run
    n = min(len(l_ref), len(l_run))
    if n < 2 * MA:
        raise SystemExit(f"too few common steps to compare: {n} (need >= {2 * MA})")
    a, b = l_ref[:n], l_run[:n]
    if [r["step"] for r in a] != [r["step"] for r in b]:
        raise SystemExit("the two logs do not cover the same steps")
    loss_a, loss_b = [r["lm_loss"] for r in a], [r["lm_loss"] for r in b]
    ma_a, ma_b = moving_avg(loss_a), moving_avg(loss_b)
    noise = statistics.pstdev([x - m for x, m in zip(loss_a[MA:], ma_a[MA:])])
    loss_gap = max(abs(x - y) for x, y in zip(ma_a, ma_b))
    om_a = [category_omega(r, categories) for r in a]
    om_b = [category_omega(r, categories) for r in b]
    om_gap = {}
    for c in CATS:
        xa = moving_avg([o.get(c, 0.0) for o in om_a])
        xb = moving_avg([o.get(c, 0.0) for o in om_b])
        om_gap[c] = max(abs(x - y) for x, y in zip(xa[MA:], xb[MA:]))
    lam_a, lam_b = a[-1]["lambdas"], b[-1]["lambdas"]
    lam_gap = {c: abs(lam_a[c]["lambda1"] - lam_b[c]["lambda1"]) for c in CATS if c in lam_a and c in lam_b}
    lam_tol = {c: 0.1 + 0.1 * abs(lam_a[c]["lambda1"]) for c in lam_gap}
    final_a = s_ref.get("omega_msr_by_category", {})
    final_b = s_run.get("omega_msr_by_category", {})
    final_gap = {c: abs(final_a[c] - final_b[c]) for c in CATS if c in final_a and c in final_b}
    checks = {
        "lm_loss_ma_within_2x_noise": loss_gap <= 2 * noise,
        "omega_ma_within_0.05": all(v <= 0.05 for v in om_gap.values()),
        "final_omega_within_0.05": bool(final_gap) and all(v <= 0.05 for v in final_gap.values()),
        "final_lambda1_within_tol": bool(lam_gap) and all(lam_gap[c] <= lam_tol[c] for c in lam_gap),
    }
    return {
        "common_steps": n,
        "lm_loss": {
            "ref_noise_std": round(noise, 5),
            "max_ma_gap": round(loss_gap, 5),
            "first": [round(loss_a[0], 4), round(loss_b[0], 4)],
            "last_ma": [round(ma_a[-1], 4), round(ma_b[-1], 4)],
            "max_abs_gap_step1": round(abs(loss_a[0] - loss_b[0]), 6),
        },
        "omega_ma_max_gap": {c: round(v, 4) for c, v in om_gap.items()},
        "final_omega_msr_by_category": {"ref": final_a, "run": final_b},
        "final_lambda1": {c: [round(lam_a[c]["lambda1"], 4), round(lam_b[c]["lambda1"], 4)] for c in lam_gap},
        "checks": checks,
        "ok": all(checks.values()),
    }


def _git_head() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except OSError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", type=Path)
    p.add_argument("run", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world-ref", type=int, default=1)
    p.add_argument("--world-run", type=int, default=2)
    p.add_argument("--ref-shared", action="store_true", help="the reference shared its GPU with another job")
    a = p.parse_args()
    from elastic_vllm.train.build import TASKS

    ref, run = load(a.ref), load(a.run)
    res = compare(ref, run, dict(TASKS))
    res["throughput"] = {"ref": throughput(ref[1], a.world_ref), "run": throughput(run[1], a.world_run)}
    res["throughput"]["ref"]["shared_gpu"] = a.ref_shared
    res["inputs"] = {"ref": str(a.ref), "run": str(a.run)}
    res["git_commit"] = os.environ.get("GIT_COMMIT") or _git_head()
    res["runs"] = {
        k: {f: s.get(f) for f in ("steps", "batch_size", "seed", "wall_s", "device", "torch", "world_size")}
        for k, s in (("ref", ref[0]), ("run", run[0]))
    }
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("common_steps", "lm_loss", "omega_ma_max_gap", "checks", "ok")}, indent=1))
    print(json.dumps(res["throughput"]))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
