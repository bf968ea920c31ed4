"""`elastic-vllm eval --suite generalization-split` end to end on a tiny random model (CPU, --quick): per held-out
family and category, dense / elastic / static rows, targets, plot; and the scoring rules."""

import gzip
import json

import pytest
from test_eval_harness import ESSAY, save_tiny_model_and_router

from elastic_vllm.eval import generalization as G
from elastic_vllm.eval import harness
from elastic_vllm.eval.baselines import calibration_prompts
from elastic_vllm.eval.ruler import write_jsonl
from elastic_vllm.hf.testing import byte_tokenizer
from elastic_vllm.train.build import build_generalization
from elastic_vllm.train.families import HELD_OUT


def tiny_suite_argv(d, sources) -> list[str]:
    """A tiny random llama (3 layers x 2 KV heads), a random router, a generalization split and calibration prompts
    under ``d``: the harness arguments that read them (without --suite and --out)."""
    save_tiny_model_and_router(d)
    tok = byte_tokenizer()
    build_generalization(
        d / "gen", tok, sources, per_family=1, min_tokens=300, max_tokens=700, stdlib=sources / "stdlib"
    )
    calib = write_jsonl(d / "calib.jsonl.xz", calibration_prompts(tok, ESSAY, (512,), 1, seed=5))
    argv = ["--model", str(d / "model"), "--router", str(d / "router")]
    return [*argv, "--gen-data", str(d / "gen" / "generalization.jsonl.gz"), "--data", str(calib), "--device", "cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, sources, one_thread):
    d = tmp_path_factory.mktemp("gen")
    out = d / "out"
    argv = ["--suite", "generalization-split", *tiny_suite_argv(d, sources)]
    argv += ["--out", str(out), "--quick", "--margins", "1000", "-1000"]
    assert harness.main(argv) == 0
    return out


def test_per_family_rows_of_every_method(run):
    res = json.loads((run / "results.json").read_text())
    assert res["kind"] == "elastic-vllm generalization" and res["complete"]
    assert set(res["table"]) == HELD_OUT
    for cells in res["table"].values():
        assert set(cells) == {"sensitive", "robust"}
        for c in cells.values():
            assert set(c) == {"dense", "elastic", "static", "elastic@1000", "elastic@-1000"}
            assert c["elastic@1000"]["omega_msr"] == 0.0 and c["elastic@-1000"]["omega_msr"] == 1.0
            assert c["dense"]["omega_msr"] == 0.0
            assert c["dense"]["keep"] == pytest.approx(1.0) or c["dense"]["score"] == 0
    # the static hybrid runs at Elastic's realized Omega_MSR of the same cell (rounded to whole heads: 6 here)
    for key, omega in res["static_hybrid"]["omega_by_cell"].items():
        fam, cat = key.split("|")
        assert res["table"][fam][cat]["elastic"]["omega_msr"] == pytest.approx(omega)
        assert abs(res["table"][fam][cat]["static"]["omega_msr"] - omega) <= 0.5 / 6 + 1e-6
    assert len(res["targets"]) == 2 * len(HELD_OUT)
    assert "--suite generalization-split" in res["provenance"]["command"] and res["provenance"]["git_commit"]
    assert (run / "generalization.png").stat().st_size > 0
    md = (run / "results.md").read_text()
    assert "| logs/system | sensitive |" in md and "Targets met in" in md
    with gzip.open(run / "samples.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    assert len(rows) == 5 * 2 * len(HELD_OUT)
    # the sa_margin trade-off: +1000 keeps every head of this random router FA, -1000 sends every head SA
    margins = {x["sa_margin"]: x for x in res["margins"]}
    assert set(margins) == {0.0, 1000.0, -1000.0}
    assert margins[1000.0]["sensitive_omega_msr"] == 0.0 and margins[-1000.0]["robust_omega_msr"] == 1.0
    assert "sa_margin trade-off" in md


def test_scores_and_targets():
    sens = {"category": "sensitive", "answer": "111, 222"}
    assert G.score(sens, "the values are 111 and 222", None) == 100.0
    assert G.score(sens, "111", None) == 50.0
    rob = {"category": "robust", "answer": "x"}
    assert G.score(rob, "a b c", "a b c") == 100.0
    table = {
        "f/a": {
            "sensitive": {"dense": {"score": 80.0}, "elastic": {"score": 72.0, "omega_msr": 0.5, "keep": 0.9}},
            "robust": {"dense": {"score": 100.0}, "elastic": {"score": 90.0, "omega_msr": 0.85, "keep": 0.9}},
        }
    }
    t = {x["category"]: x for x in G.check_targets(table)}
    assert not t["sensitive"]["met"] and "keep 90% < 95%" in t["sensitive"]["miss"]
    assert "Omega_MSR 0.50 > 0.4 by 0.10" in t["sensitive"]["miss"]
    assert t["robust"]["met"]


def test_suite_needs_a_router(tmp_path):
    with pytest.raises(ValueError, match="needs the trained router"):
        harness.main(["--suite", "generalization-split", "--model", str(tmp_path), "--out", str(tmp_path / "o")])


def test_load_rows_caps_cells_and_length(tmp_path):
    from elastic_vllm.train.build import write_jsonl

    rows = [
        {"task": "retrieval", "category": c, "messages": [], "answer": "1", "family": f, "tokens": t}
        for f in ("a/after", "b/before")
        for c in ("sensitive", "robust")
        for t in (500, 3000, 800, 900)
    ]
    write_jsonl(rows, tmp_path / "g.jsonl")
    got = G.load_rows(tmp_path / "g.jsonl", 2, max_tokens=1000)
    assert [r["tokens"] for r in got] == [500, 800] * 4
    assert [r["index"] for r in got] == [0, 1] * 4
    with pytest.raises(ValueError, match="row without 'family'"):
        bad = dict(rows[0])
        del bad["family"]
        write_jsonl([bad], tmp_path / "bad.jsonl")
        G.load_rows(tmp_path / "bad.jsonl", 1)
