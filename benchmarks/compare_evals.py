"""Two accuracy runs of the same prompts, sample by sample: how often the prediction, the score and the
routing differ (e.g. the transformers engine's torch path against its Triton path, or two GPUs).

    python3 benchmarks/compare_evals.py RUN_A RUN_B [--methods dense elastic] [--out FILE.json]

RUN_A / RUN_B: folders written by benchmarks/accuracy.py (samples.jsonl.gz + results.json). Samples are matched
on (method, task, length, index); a sample in only one run is counted, not compared.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path


def load_samples(run: Path) -> list[dict]:
    path = run / "samples.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no samples.jsonl.gz (not a benchmarks/accuracy.py output folder)")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(a: list[dict], b: list[dict], methods: list[str] | None = None, tol: float = 1e-9) -> dict:
    """Per method: matched samples, and how many differ in prediction, score and realized Omega_MSR."""

    def key(x: dict) -> tuple:
        return (x["method"], x["task"], x["length"], x["index"])

    ia, ib = {key(x): x for x in a}, {key(x): x for x in b}
    out = {}
    for m in methods or sorted({k[0] for k in ia} & {k[0] for k in ib}):
        ka = {k for k in ia if k[0] == m}
        kb = {k for k in ib if k[0] == m}
        both = sorted(ka & kb)
        if not both:
            raise ValueError(f"method {m!r}: no sample in both runs")
        out[m] = {
            "matched": len(both),
            "only_a": len(ka - kb),
            "only_b": len(kb - ka),
            "pred_differs": sum(ia[k].get("pred") != ib[k].get("pred") for k in both),
            "score_differs": sum(abs(ia[k]["score"] - ib[k]["score"]) > tol for k in both),
            "routing_differs": sum(abs(ia[k]["omega_msr"] - ib[k]["omega_msr"]) > tol for k in both),
            "mean_score_a": sum(ia[k]["score"] for k in both) / len(both),
            "mean_score_b": sum(ib[k]["score"] for k in both) / len(both),
            "mean_omega_msr_a": sum(ia[k]["omega_msr"] for k in both) / len(both),
            "mean_omega_msr_b": sum(ib[k]["omega_msr"] for k in both) / len(both),
        }
    return out


def run_meta(run: Path) -> dict:
    r = json.loads((run / "results.json").read_text())
    p = r.get("provenance", {})
    return {"dir": str(run), "impl": r.get("options", {}).get("impl"), "dtype": r.get("options", {}).get("dtype"),
            "gpu": p.get("gpu"), "git_commit": p.get("git_commit"), "command": p.get("command")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--methods", nargs="+")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:
        res = compare(load_samples(args.run_a), load_samples(args.run_b), args.methods)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare_evals: {e}", file=sys.stderr)
        return 2
    doc = {"command": "python3 benchmarks/compare_evals.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "a": run_meta(args.run_a), "b": run_meta(args.run_b), "methods": res}  # fmt: skip
    for m, r in res.items():
        print(f"{m}: {r['matched']} samples, prediction differs {r['pred_differs']}, score {r['score_differs']}, "
              f"routing {r['routing_differs']}; mean score {r['mean_score_a']:.2f} vs {r['mean_score_b']:.2f}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
