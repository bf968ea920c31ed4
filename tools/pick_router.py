#!/usr/bin/env python3
"""Pick the best of several trained routers by their measure.json (scripts/measure_trained_router.py).

    python tools/pick_router.py DEST RUN_DIR [RUN_DIR ...]

Each RUN_DIR holds router.json, router.safetensors and measure.json. Ranking: more targets met first,
then task separation (robust - sensitive Omega_MSR) minus 5x any needle drop beyond the 2-point bound.
Copies the winner's router files into DEST and prints why. Exit 1 when no run has a measured router.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def score(m: dict) -> tuple[int, float]:
    t = m["targets"]
    met = sum(bool(v["met"]) for v in t.values())
    sep = t["robust_minus_sensitive"]["value"]
    drop = t["needle_drop_vs_all_fa"]["value"]
    return met, sep - 5.0 * max(0.0, drop - 0.02)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dest, runs = Path(argv[0]), [Path(a) for a in argv[1:]]
    scored = []
    for r in runs:
        m = r / "measure.json"
        if not (m.is_file() and (r / "router.json").is_file() and (r / "router.safetensors").is_file()):
            print(f"{r}: no measured router, skipped")
            continue
        s = score(json.loads(m.read_text()))
        print(f"{r}: targets met {s[0]}, score {s[1]:.3f}")
        scored.append((s, str(r)))
    if not scored:
        print("no run has a measured router", file=sys.stderr)
        return 1
    best = Path(max(scored)[1])
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("router.json", "router.safetensors", "measure.json"):
        shutil.copy2(best / f, dest / f)
    print(f"picked {best} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
