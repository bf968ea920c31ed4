"""tools/compare_train_runs.py: the FSDP-vs-one-GPU comparison must pass for identical runs and fail for
two different recipes (committed H200 runs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RES = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("compare_train_runs", ROOT / "tools" / "compare_train_runs.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _tasks():
    from elastic_vllm.train.build import TASKS

    return dict(TASKS)


def test_identical_runs_match(mod):
    run = mod.load(RES / "router-train-smollm2-h200")
    res = mod.compare(run, run, _tasks())
    assert res["ok"] and res["lm_loss"]["max_ma_gap"] == 0.0
    assert res["common_steps"] == len(run[1])


def test_different_recipes_do_not_match(mod):
    a = mod.load(RES / "router-train-smollm2-s040-h200")
    b = mod.load(RES / "router-train-smollm2-h200")
    res = mod.compare(a, b, _tasks())
    assert not res["ok"]
    assert not res["checks"]["omega_ma_within_0.05"]


def test_throughput_counts_tokens_per_gpu(mod):
    log = [{"tokens": 1000, "step_s": 1.0}] * 8
    assert mod.throughput(log, 1)["tokens_per_s_per_gpu_median"] == 1000.0
    assert mod.throughput(log, 2)["tokens_per_s_per_gpu_median"] == 500.0


def test_cli_writes_json(mod, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "c.json"
    d = RES / "router-train-smollm2-h200"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_train_runs.py"), str(d), str(d),
                        "--out", str(out), "--world-run", "1"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["ok"] is True
