"""`elastic-vllm eval --suite budgets` end to end on a tiny random model (CPU, --quick): at each target the
router-ranked, static and random head choices realize the same exact Omega_MSR and differ only in which heads;
and the static / random budgets against the per-layer counts."""

import gzip
import json
import math

import pytest
import torch
from test_eval_generalization import tiny_suite_argv

from elastic_vllm.eval import budgets as B
from elastic_vllm.eval import harness
from elastic_vllm.router.model import budget_sa_counts

TARGETS = (0.25, 0.5, 0.9)


@pytest.fixture(scope="module")
def run(tmp_path_factory, sources, one_thread):
    d = tmp_path_factory.mktemp("budgets")
    out = d / "out"
    argv = ["--suite", "budgets", *tiny_suite_argv(d, sources), "--out", str(out), "--quick"]
    assert harness.main([*argv, "--targets", *map(str, TARGETS)]) == 0
    return out


def test_every_head_choice_realizes_the_exact_budget(run):
    res = json.loads((run / "results.json").read_text())
    assert res["kind"] == "elastic-vllm budgets" and res["complete"] and res["targets"] == list(TARGETS)
    with gzip.open(run / "samples.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    n_prompts = len([r for r in rows if r["method"] == "dense"])
    assert n_prompts == 2 * B.QUICK_PER_CATEGORY
    assert len(rows) == n_prompts * (2 + 3 * len(TARGETS))
    heads = 3 * 2  # the tiny llama: 3 layers x 2 KV heads
    for t in TARGETS:
        for kind in B.KINDS:
            got = [r["omega_msr"] for r in rows if r["method"] == f"{kind}@{t:g}"]
            # the engine's Omega_MSR is a float32 mean: exact counts, compared within float32 rounding
            assert got == pytest.approx([math.floor(t * heads + 0.5) / heads] * n_prompts, abs=1e-6), (kind, t)
    assert all(r["omega_msr"] == 0.0 for r in rows if r["method"] == "dense")
    for cat, table in res["curves"].items():
        assert set(table) == {"dense", "router (own Omega)", *B.KINDS}, cat
        assert [p["target"] for p in table["router"]] == list(TARGETS)
    assert "--suite budgets" in res["provenance"]["command"]
    assert (run / "budgets.png").stat().st_size > 0
    assert "| router | 0.5 | 0.500 |" in (run / "results.md").read_text()


def test_static_and_random_budgets_keep_the_per_layer_counts():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(30, 3, generator=g)
    for t in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0):
        counts = budget_sa_counts(t, 30, 0, 1, 3)
        fa = B.static_budget(scores, t)
        assert (~fa).sum(1).tolist() == counts
        for layer in range(30):  # the lowest retrieval scores go SA
            sa, keep = scores[layer][~fa[layer]], scores[layer][fa[layer]]
            assert sa.numel() == 0 or keep.numel() == 0 or sa.max() <= keep.min()
        rnd = B.random_budget(t, 4, 30, 3, g)
        assert all((~rnd[b]).sum(1).tolist() == counts for b in range(4))
    rnd = B.random_budget(0.5, 64, 30, 3, torch.Generator().manual_seed(0))
    assert len({tuple(r.flatten().tolist()) for r in rnd}) > 1  # rows choose different heads
