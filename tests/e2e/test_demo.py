"""The main job, as the README's first command runs it: `elastic-vllm demo` serves the demo model with
`vllm serve --attention-backend elastic` (CPU here) and the SHIPPED router (router_weights/), sends a needle,
a summary and a code request, and prints each answer with the Omega_MSR read from the server's /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_vllm.router.checkpoint import load_router

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(
    r"^(needle \(sensitive\)|summary \(robust\)|code \(robust\))\s+(\d+) tok\s+(\S+)\s+\d+\.\d s  \S", re.M
)


def test_elastic_vllm_demo_runs_the_shipped_router_end_to_end():
    shipped = ROOT / "router_weights" / "smollm2-135m-instruct"
    load_router(shipped)  # the default router of the main job exists and is valid
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-m", "elastic_vllm.cli", "demo"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    rows = {m.group(1): (int(m.group(2)), m.group(3)) for m in ROW.finditer(p.stdout)}
    assert set(rows) == {"needle (sensitive)", "summary (robust)", "code (robust)"}, p.stdout
    assert "Omega_MSR = share of the request's KV heads (30 layers x 3 KV heads) the router sent to SA" in p.stdout
    for name, (tokens, msr) in rows.items():
        assert tokens > 50, name
        assert re.fullmatch(r"\d\.\d{3}", msr), f"{name}: no routing recorded on /metrics ({msr})"
        assert 0.0 <= float(msr) <= 1.0, (name, msr)
    # the trained router is not a constant: the three prompts get different shares of SA heads
    assert len({msr for _, msr in rows.values()}) > 1, rows
    assert "[correct]" in p.stdout  # the needle is found (exit code 0 also requires it)
