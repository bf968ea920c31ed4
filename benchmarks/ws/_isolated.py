"""Run each named case of a script in its own process (a bad GPU build can hang or poison the CUDA context) and
collect the JSON line each prints last into one report: ``python3 SCRIPT --out PATH [names...]``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))


def run_cases(script: str, what: str, key: str, names, timeout_s: int, env: dict | None = None) -> None:
    """Parent side: argv is ``SCRIPT --out PATH [names...]``; each child runs ``SCRIPT --<key> NAME``."""
    from _gpu_common import env_info, write_json

    out = sys.argv[2] if len(sys.argv) > 2 else None
    report = {"what": what, "env": env_info(), "rows": []}
    for name in sys.argv[3:] or names:
        try:
            p = subprocess.run([sys.executable, script, f"--{key}", name], capture_output=True, text=True,
                               timeout=timeout_s, env={**os.environ, **(env or {})})  # fmt: skip
            last = (p.stdout.strip().splitlines() or ["{}"])[-1]
            row = json.loads(last) if p.returncode == 0 else {"error": (p.stderr.strip().splitlines() or [""])[-1]}
        except subprocess.TimeoutExpired:
            row = {"error": "timeout (hang)"}
        report["rows"].append({key: name, **row})
        print(report["rows"][-1], flush=True)
        write_json(out, report)


def is_parent() -> bool:
    return len(sys.argv) == 1 or sys.argv[1] == "--out"
