"""The trained-router measurement (Omega_MSR per task, needle routing vs all-FA) on a tiny model."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from elastic_vllm.eval.router_eval import format_report, measure
from elastic_vllm.hf.testing import save_tiny_model
from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, save_router
from elastic_vllm.router.model import ElasticRouter

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_trained_router.py"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("measure")
    model = save_tiny_model("llama", root / "model")
    torch.manual_seed(0)
    meta = RouterMeta(
        backbone=BackboneMeta(num_layers=3, num_kv_heads=2, head_dim=16, id="tiny"),
        attention={"mode": "FA-SSA", "sink": 4, "window": 32},
    )
    router = save_router(ElasticRouter(3, 16), root / "router", meta)
    rows = [
        {
            "task": t,
            "category": c,
            "messages": [{"role": "user", "content": f"{t} prompt number {i} " * 8}],
            "answer": "x",
        }
        for t, c in (("qa", "sensitive"), ("code", "robust"))
        for i in range(3)
    ]
    ev = root / "eval.jsonl"
    ev.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, router, rows, ev


def test_measure_reports_omega_per_task_and_needle_both_ways(setup):
    model, router, rows, _ = setup
    res = measure(model, router, rows, lengths=[150, 250], per_length=2, device="cpu")
    om = res["omega"]
    assert set(om["omega_msr_by_task"]) == {"qa", "code"} and om["n_by_task"] == {"qa": 3, "code": 3}
    assert all(0.0 <= v <= 1.0 for v in om["omega_msr_by_task"].values())
    assert om["robust_minus_sensitive"] == pytest.approx(
        om["omega_msr_by_category"]["robust"] - om["omega_msr_by_category"]["sensitive"]
    )
    nd = res["needle"]
    assert set(nd["accuracy"]) == {"auto", "all-FA"} and set(nd["accuracy"]["auto"]) == {150, 250}
    assert res["attention"]["window"] == 32
    assert set(res["targets"]) == {"robust_minus_sensitive", "needle_drop_vs_all_fa"}
    assert "| qa |" in format_report(res)


def test_measure_script_writes_json(setup, tmp_path, monkeypatch, capsys):
    model, router, _, ev = setup
    out = tmp_path / "m.json"
    argv = [
        "x",
        "--model",
        str(model),
        "--router",
        str(router),
        "--eval",
        str(ev),
        "--lengths",
        "150",
        "--per-length",
        "1",
        "--device",
        "cpu",
        "--haystack",
        "noise",
        "--out",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert e.value.code == 0
    res = json.loads(out.read_text())
    assert res["haystack"] == "noise"
    prov = res["provenance"]  # what a committed result file must say about where it came from
    assert prov["device"] == "cpu" and prov["gpu"] == "none (cpu)" and "--per-length" in prov["command"]
    assert prov["torch"] and prov["transformers"] and prov["git_commit"]
    assert "needle accuracy" in capsys.readouterr().out
