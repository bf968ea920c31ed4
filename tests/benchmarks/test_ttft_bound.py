"""benchmarks/ttft_bound.py: the attention rate a TTFT target needs, from a synthetic e2e result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ttft_bound  # noqa: E402


def brute_pairs(n: int, sink: int, window: int, sa: bool) -> int:
    return sum(1 for i in range(n) for j in range(i + 1) if not sa or j < sink or i - j < window)


def report(flash_s=1.0, fa3_s=0.5, attn_s=0.2, busy_s=0.7, wall_s=0.72, n=300, share=0.75):
    prof = lambda kernels, busy, wall: {"wall_s": wall, "gpu_busy_s": busy, "top_kernels": kernels}  # noqa: E731
    return {
        "engine": {"elastic": {"sink": 4, "window": 50}},
        "git_commit": "abc",
        "ttft": [
            {"backend": "FLASH_ATTN", "variant": "FLASH_ATTN", "len": n, "median_s": flash_s},
            {"backend": "FLASH_ATTN", "variant": "FLASH_ATTN profiled", "len": n, "median_s": flash_s,
             "profile": prof([{"name": "cutlass::FlashAttnFwdSm90<...>", "ms": fa3_s * 1e3},
                              {"name": "nvjet_gemm", "ms": 400.0}], 0.9, 0.92)},
            {"backend": "elastic", "variant": "elastic profiled", "len": n, "share": share, "median_s": 0.9,
             "profile": prof([{"name": "_prefill_kernel", "ms": attn_s * 1e3 * 0.9},
                              {"name": "_route_task_kernel", "ms": attn_s * 1e3 * 0.1},
                              {"name": "nvjet_gemm", "ms": 400.0}], busy_s, wall_s)},
        ],
    }  # fmt: skip


def test_flops_count_every_visible_pair():
    n, sink, window, hq, d, layers = 300, 4, 50, 4, 8, 2
    want = 4 * d * layers * (1 * brute_pairs(n, sink, window, False) + 3 * brute_pairs(n, sink, window, True))
    assert ttft_bound.attention_flops(n, 0.75, sink, window, hq, d, layers) == want


def test_bound_arithmetic():
    (row,) = ttft_bound.bounds(report(), {300: 1.4}, hq=4, d=8, layers=2)
    flops = ttft_bound.attention_flops(300, 0.75, 4, 50, 4, 8, 2)
    dense = ttft_bound.attention_flops(300, 0.0, 4, 50, 4, 8, 2)
    assert row["elastic_attention_s"] == pytest.approx(0.2)
    assert row["elastic_other_gpu_s"] == pytest.approx(0.5)
    assert row["elastic_host_only_s"] == pytest.approx(0.02)
    budget = 1.0 / 1.4 - 0.5 - 0.02
    assert row["attention_budget_s"] == pytest.approx(budget)
    assert row["needed_TFLOPs"] == pytest.approx(flops / budget / 1e12)
    assert row["fa3_dense_TFLOPs_in_vllm"] == pytest.approx(dense / 0.5 / 1e12)
    assert row["speedup_at_fa3_rate"] == pytest.approx(1.0 / (0.52 + flops / (dense / 0.5)))
    assert row["max_speedup_attention_free"] == pytest.approx(1.0 / 0.52)


def test_unreachable_target_has_no_rate():
    (row,) = ttft_bound.bounds(report(busy_s=0.9, attn_s=0.1), {300: 2.0}, hq=4, d=8, layers=2)
    assert row["attention_budget_s"] < 0 and row["needed_TFLOPs"] is None


def test_script_writes_json(tmp_path):
    src = tmp_path / "e2e.json"
    src.write_text(json.dumps(report(n=32768)))
    out = tmp_path / "bound.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ttft_bound.py"), str(src), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["len"] == 32768 and rows[0]["target_speedup"] == 1.4
