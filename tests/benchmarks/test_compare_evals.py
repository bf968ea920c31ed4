"""benchmarks/compare_evals.py: sample-by-sample agreement of two accuracy runs."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_evals", ROOT / "benchmarks" / "compare_evals.py")
ce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ce)


def sample(method, task, index, pred, score, omega):
    return {"method": method, "task": task, "length": 4096, "index": index, "pred": pred, "score": score,
            "omega_msr": omega}  # fmt: skip


def write_run(d: Path, samples: list[dict]) -> Path:
    d.mkdir()
    with gzip.open(d / "samples.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    (d / "results.json").write_text(json.dumps({"options": {"impl": "torch"}, "provenance": {"gpu": "x"}}))
    return d


def test_counts_each_kind_of_difference(tmp_path):
    a = [sample("dense", "t", 0, "a", 100.0, 0.0), sample("dense", "t", 1, "b", 0.0, 0.0),
         sample("elastic", "t", 0, "a", 100.0, 0.5), sample("elastic", "t", 1, "b", 50.0, 0.25),
         sample("elastic", "u", 0, "c", 0.0, 0.5)]  # fmt: skip
    b = [sample("dense", "t", 0, "a", 100.0, 0.0), sample("dense", "t", 1, "B", 0.0, 0.0),
         sample("elastic", "t", 0, "a", 100.0, 0.5), sample("elastic", "t", 1, "x", 0.0, 0.5)]  # fmt: skip
    ra, rb = write_run(tmp_path / "a", a), write_run(tmp_path / "b", b)
    out = tmp_path / "cmp.json"
    assert ce.main([str(ra), str(rb), "--out", str(out)]) == 0
    res = json.loads(out.read_text())["methods"]
    assert res["dense"] == {**res["dense"], "matched": 2, "pred_differs": 1, "score_differs": 0, "routing_differs": 0}
    e = res["elastic"]
    assert (e["matched"], e["only_a"], e["only_b"]) == (2, 1, 0)
    assert (e["pred_differs"], e["score_differs"], e["routing_differs"]) == (1, 1, 1)
    assert e["mean_score_a"] == pytest.approx(75.0) and e["mean_score_b"] == pytest.approx(50.0)


def test_bad_input_is_named(tmp_path, capsys):
    ra = write_run(tmp_path / "a", [sample("dense", "t", 0, "a", 1.0, 0.0)])
    assert ce.main([str(ra), str(tmp_path / "missing")]) == 2
    assert "no samples.jsonl.gz" in capsys.readouterr().err
    assert ce.main([str(ra), str(ra), "--methods", "static"]) == 2
    assert "method 'static': no sample in both runs" in capsys.readouterr().err
