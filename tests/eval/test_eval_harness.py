"""The accuracy harness end to end on a tiny random model (CPU, --quick): plumbing, output schema, plots."""

import gzip
import json
from pathlib import Path

import pytest

from elastic_vllm.eval import harness
from elastic_vllm.eval.baselines import calibration_prompts
from elastic_vllm.eval.needle import make_needle_prompt
from elastic_vllm.eval.robust import generate_robust, in_router_eval_split
from elastic_vllm.eval.ruler import write_jsonl
from elastic_vllm.hf.testing import byte_tokenizer, save_tiny_model, sharp_router
from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, save_router

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 512
ESSAY = " ".join(
    f"Essay sentence {i} is about the {w} of the valley." for i, w in enumerate(["oak", "fox", "sun"] * 60)
)
CODE = (Path(harness.__file__).parent / "metrics.py").read_text() * 2


def _records(tok) -> list[dict]:
    rows = []
    for i in range(2):
        p = make_needle_prompt(tok, 300, depth=0.3 + 0.4 * i, seed=i)
        text = p.text(tok)
        rows.append(
            {
                "index": i,
                "task": "niah_single_1",
                "length": LENGTH,
                "input": text,
                "outputs": [p.answer],
                "metric": "string_match_all",
                "tokens_to_generate": 128,
                "prompt_tokens": len(tok.encode(text, add_special_tokens=False)),
            }
        )
    rows += generate_robust(tok, [LENGTH], {"summ": 1, "cont": 1, "code": 1}, essays=ESSAY, code=CODE)
    rows += calibration_prompts(tok, ESSAY, (LENGTH,), 1, seed=5)
    return rows


def save_tiny_model_and_router(d) -> None:
    """A tiny random llama (3 layers x 2 KV heads) in d/model and a sharp random router for it in d/router."""
    save_tiny_model("llama", d / "model", seed=2)
    meta = RouterMeta(
        backbone=BackboneMeta(num_layers=3, num_kv_heads=2, head_dim=16, id="tiny"),
        attention={"mode": "FA-SSA", "sink": 16, "window": 64},
    )
    save_router(sharp_router(seed=0), d / "router", meta)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("acc")
    save_tiny_model_and_router(d)
    data = write_jsonl(d / "data.jsonl.xz", _records(byte_tokenizer()))
    out = d / "out"
    argv = ["--model", str(d / "model"), "--router", str(d / "router"), "--data", str(data)]
    argv += ["--lengths", str(LENGTH), "--out", str(out), "--device", "cpu", "--quick"]
    assert harness.main(argv) == 0
    out.joinpath("argv.json").write_text(json.dumps(argv))
    return out


def _samples(out: Path) -> dict:
    with gzip.open(out / "samples.jsonl.gz", "rt") as f:
        return {(s["method"], s["task"], s["index"]): s for s in map(json.loads, f)}


@pytest.mark.slow  # the Triton kernels under the interpreter for the whole run: 554 s on the shared 2-core machine
def test_triton_impl_scores_as_the_torch_impl(run, tmp_path):
    """--impl triton (the Triton kernels, under the interpreter here) on the same prompts: every method's routing,
    predictions and scores as with --impl torch (float32 on the CPU: the kernels' numerics are within
    rounding of PyTorch's)."""
    argv = json.loads((run / "argv.json").read_text())
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    methods = ["elastic", "elastic-sparse", "FA-XA"]  # SSA and XA prefill, dense and sparse decode
    assert harness.main([*argv, "--impl", "triton", "--methods", *methods]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["options"]["impl"] == "triton" and res["complete"] is True
    ref, got = _samples(run), _samples(tmp_path / "out")
    assert {k[0] for k in got} == {"dense", *methods}
    for key, s in got.items():
        r = ref[key]
        assert (s["omega_msr"], s.get("pred")) == (r["omega_msr"], r.get("pred")), key
        assert s["score"] == pytest.approx(r["score"], rel=1e-4, abs=1e-4), key


def test_outputs_schema(run):
    res = json.loads((run / "results.json").read_text())
    assert res["complete"] is True and res["skipped"] == []
    p = res["provenance"]
    for k in ("command", "git_commit", "gpu", "torch", "transformers"):
        assert p[k], k
    assert "--quick" in p["command"]
    assert list(res["methods"]) == list(harness.METHODS)  # every method ran, in the canonical order
    # the SSA knobs come from router.json's attention block
    assert res["methods"]["elastic"]["config"]["sink"] == 16 and res["methods"]["elastic"]["config"]["window"] == 64
    assert res["methods"]["XA-SSA"]["config"]["mode"] == "XA-SSA"
    t = res["table"]
    for m in harness.METHODS:
        cells = t[m][str(LENGTH)]
        for task in ("niah_single_1", "summ", "cont", "code", "ruler_avg", "robust_avg"):
            assert task in cells, (m, task)
        assert cells["niah_single_1"]["n"] == (1 if harness.METHODS[m].xa else 2)
    dense, all_sa = t["dense"][str(LENGTH)], t["all-SA"][str(LENGTH)]
    assert dense["ruler_avg"]["omega_msr"] == 0 and dense["ruler_avg"]["omega_esr"] == 0
    assert dense["summ"]["score"] == 100.0 and dense["cont"]["score"] == pytest.approx(100.0)
    assert all_sa["ruler_avg"]["omega_msr"] == 1.0 and 0 < all_sa["ruler_avg"]["omega_esr"] < 1
    # static hybrid: at Elastic's realized RULER average, with its routing and ranking recorded
    sh = res["static_hybrid"]
    assert sh["omega_msr"] == pytest.approx(t["elastic"][str(LENGTH)]["niah_single_1"]["omega_msr"])
    assert len(sh["is_fa"]) == 3 and len(sh["retrieval_scores"][0]) == 2
    assert sh["matched_on"].startswith("Elastic's mean Omega_MSR on the sensitive samples")
    assert t["static"][str(LENGTH)]["niah_single_1"]["omega_msr"] == pytest.approx(round(sh["omega_msr"] * 6) / 6)
    assert len(res["targets"]) == 3 and all(isinstance(x["met"], bool) for x in res["targets"])
    freq = res["fa_frequency"]["elastic"][str(LENGTH)]
    assert set(freq) == {"sensitive", "robust"} and len(freq["sensitive"]) == 3


def test_outputs_files(run):
    for f in ("pareto.png", "msr_per_task.png", "fa_heatmap.png"):
        assert (run / f).stat().st_size > 5000, f
    md = (run / "results.md").read_text()
    assert "| task | dense | elastic | static |" in md and "## Targets" in md
    with gzip.open(run / "samples.jsonl.gz", "rt") as f:
        samples = [json.loads(line) for line in f]
    assert {s["method"] for s in samples} == set(harness.METHODS)
    assert all(0.0 <= s["omega_msr"] <= 1.0 and 0.0 <= s["omega_esr"] <= 1.0 for s in samples)
    code = [s for s in samples if s["task"] == "code"]
    assert all("\n" not in s["pred"].strip() for s in code)  # next-line completion stops at the line end


def test_missing_router_and_data_errors(tmp_path):
    p = __import__("argparse").ArgumentParser()
    harness.add_args(p)
    opts = p.parse_args(["--model", "x", "--out", str(tmp_path), "--methods", "elastic", "--data", "nope.jsonl"])
    with pytest.raises(ValueError, match="need the trained router"):
        harness.run(opts)
    opts = p.parse_args(["--model", "x", "--out", str(tmp_path), "--data", str(tmp_path / "nope.jsonl")])
    with pytest.raises(FileNotFoundError, match=r"eval\.prepare"):
        harness.run(opts)


def test_cli_has_eval_subcommand():
    from elastic_vllm.cli import build_parser

    a = build_parser().parse_args(["eval", "--model", "m", "--out", "o", "--quick"])
    assert a.cmd == "eval" and a.quick and a.lengths == [4096, 8192]


def test_code_texts_are_held_out_from_router_training():
    from elastic_vllm.train.build import in_eval

    keys = [f"stdlib:{k}.py" for k in ("json/decoder", "zipfile", "asyncio/events", "ast", "typing", "bisect")]
    assert [in_router_eval_split(k) for k in keys] == [in_eval(k) for k in keys]


def test_static_target_omega_sensitive_or_whole_workload():
    samples = [
        {"method": "elastic", "category": "sensitive", "omega_msr": 0.5},
        {"method": "elastic", "category": "sensitive", "omega_msr": 0.3},
        {"method": "elastic", "category": "robust", "omega_msr": 1.0},
        {"method": "static", "category": "sensitive", "omega_msr": 0.9},  # not Elastic's: ignored
    ]
    om, what = harness.static_target_omega(samples, "sensitive")
    assert om == pytest.approx(0.4) and "sensitive" in what and "n=2" in what
    om, what = harness.static_target_omega(samples, "all")
    assert om == pytest.approx(0.6) and "all its samples" in what and "n=3" in what
    robust_only = [s for s in samples if s["category"] == "robust"]
    om, what = harness.static_target_omega(robust_only, "sensitive")
    assert om == pytest.approx(1.0) and "no sensitive ones" in what
    with pytest.raises(RuntimeError, match="no samples"):
        harness.static_target_omega([], "all")
    with pytest.raises(ValueError, match="static match"):
        harness.static_target_omega(samples, "robust")
