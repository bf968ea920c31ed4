"""benchmarks/kernels.py (the registry of the kernels_*.py questions) and tools/tune_kernels.py end to end under
TRITON_INTERPRET (``--cpu-dry``: toy sizes): the sections the GPU session relies on run, check their outputs against
each other and write the JSON. Plumbing only: no time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, tmp_path, *args: str, timeout: float = 900) -> tuple[dict, str]:
    """Run ``script`` (relative to the repository) with ``--out`` in tmp_path: (its JSON, its stdout); it must
    exit 0 and, where it records section errors, record none."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / script), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert not d.get("errors"), d.get("errors")
    return d, proc.stdout


@pytest.mark.slow
def test_kernels_benchmark_dry_run(tmp_path):
    d, _stdout = run_script(
        "benchmarks/kernels.py", tmp_path, "--cpu-dry", "--sections", "correctness,vllm,decode,prefill S=", timeout=900
    )
    assert d["correctness"] and all(c["ok"] for c in d["correctness"])
    # vLLM's interleaved K/V layout and chunked prefill compute the same attention as one call over two planes
    rows = {(r["layout"], r["chunks"]): r for r in d["prefill_vllm"]}
    assert set(rows) == {("planes", 1), ("planes", 2), ("vllm_interleaved", 1), ("vllm_interleaved", 2)}
    assert all(r["rel_diff_vs_first"] < 1e-2 and r["ms"] > 0 for r in rows.values())
    assert {r["mode"] for r in d["decode"]} == {"dense", "sparse"}
    # vLLM's FA3 anchor: on the CPU its row says why it did not run, and no ratio against it is made up
    fa3 = [r for r in d["prefill"] if r["method"] == "vllm_fa3_dense"]
    assert fa3 and all("CUDA" in r["error"] and "ms" not in r for r in fa3)
    ours = [r for r in d["prefill"] if r["method"] == "ours"]
    assert ours and all("x_vs_fa3_dense" not in r and r["x_vs_sdpa"] > 0 for r in ours)


@pytest.mark.slow
def test_xattn_section_dry_run(tmp_path):
    """The XAttention section (selection, attention over the selection, both; per mode) runs and its rows
    hang together: a lower threshold keeps fewer blocks, FA-SSA / all-FA rows have no selection."""
    d, _stdout = run_script("benchmarks/kernels.py", tmp_path, "--cpu-dry", "--sections", "xattn", timeout=900)
    rows = {(r["mode"], r["threshold"]): r for r in d["xattn"]}
    xa = [(m, t) for m in ("FA-XA", "XA-SSA", "all-XA") for t in (0.9, 0.3)]
    assert set(rows) == {("FA-SSA", None), ("all-FA", None), *xa}
    for m, t in xa:
        r = rows[(m, t)]
        assert 0 < r["selected_share"] <= 1 and all(r[k]["ms"] > 0 for k in ("select", "attn", "both"))
        assert rows[(m, 0.3)]["selected_share"] < rows[(m, 0.9)]["selected_share"]
    assert all("select" not in rows[(m, None)] for m in ("FA-SSA", "all-FA"))
    assert d["xattn_kernels"]["select"] and d["xattn_kernels"]["prefill"]


@pytest.mark.slow
def test_tuning_sweeps_dry_run(tmp_path):
    """tools/tune_kernels.py: every prefill candidate agrees with the first (the default) and the winner is printed
    as the prefill benchmarks' --prefill-config; the decode tile sweep's variants agree with the default."""
    d, stdout = run_script(
        "tools/tune_kernels.py", tmp_path, "--cpu-dry", "--sections", "tune d128,decode config", timeout=900
    )
    assert len(d["tune"]) == 2 and all(r["rel_diff_vs_first_0.75"] < 1e-2 and r["ms_0.75"] > 0 for r in d["tune"])
    best = d["best_prefill_config"]["128"]
    assert best in [{k: r[k] for k in best} for r in d["tune"]] and "--prefill-config" in stdout
    cfg = d["decode_config"]
    assert {r["mode"] for r in cfg} == {"dense", "sparse"} and all(r["rel_diff_vs_first"] < 1e-2 for r in cfg)


def test_host_overhead_script_reports_every_launcher(tmp_path):
    d, _stdout = run_script("benchmarks/host_overhead.py", tmp_path, "--calls", "20", "--repeats", "1", timeout=300)
    assert {"prefill_attention", "decode_attention", "Router.__call__ (2 launches)"} < set(d["us_per_call"])
    assert sum("layer routing" in k for k in d["us_per_call"]) == 2
    assert all(v > 0 for v in d["us_per_call"].values()) and d["git_commit"] and d["command"]


def test_fa_split_benchmark_dry_run(tmp_path):
    """benchmarks/fa_split.py on toy steps: every split output was checked against the fused kernel (the rows
    are the table FA_SPLIT_MIN_SEQ is read from) and both sides were timed."""
    d, _stdout = run_script(
        "benchmarks/fa_split.py", tmp_path, "--cpu-dry", "--shapes", "demo", "--shares", "0,0.5,1", timeout=600
    )
    rows = d["rows"]
    assert {r["case"] for r in rows} == {"1x96", "2x48", "ctx160 q64"} and {r["share"] for r in rows} == {0, 0.5, 1}
    assert all(r["ok"] and r["rel_err"] < d["config"]["rtol"] and r["fused_ms"] > 0 and r["split_ms"] > 0 for r in rows)
    assert any(r["rel_err"] > 0 for r in rows if r["share"] < 1)  # the split really ran another kernel
