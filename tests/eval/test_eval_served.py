"""`elastic-vllm eval --suite generalization`: the held-out prompt generators (deterministic, every answer exactly
once, distractors unlike the answers, question placement), the scoring, the static-ranking router and the
aggregation; the slow test runs a slice end to end through real `elastic-vllm serve` servers."""

import gzip
import json
import re

import pytest
import torch

from elastic_vllm.eval import harness
from elastic_vllm.eval import heldout as H
from elastic_vllm.eval import served as S
from elastic_vllm.hf.testing import byte_tokenizer

TOKENS = 900  # bytes with the byte tokenizer: enough haystack for every fact and block


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    return {H.family_name(*c): [H.make_prompt(*c, i, tok, TOKENS) for i in range(3)] for c in H.design_cells()}


def test_design_covers_kinds_haystacks_and_placements():
    kinds, hays = {}, {}
    for k, h, _ in H.CELLS:
        kinds.setdefault(k, set()).add(h)
        hays.setdefault(h, set()).add(k)
    assert set(kinds) == set(H.KINDS) and all(len(x) >= 2 for x in kinds.values())
    assert set(hays) == set(H.HAYSTACKS) and all(len(x) >= 2 for x in hays.values())
    assert {p for *_, p in H.CELLS} == set(H.PLACEMENTS)
    assert ("number", "docs", "after") in H.CELLS and ("number", "code", "after") in H.CELLS
    assert {h for _, h, _ in H.ROBUST_CELLS} == set(H.HAYSTACKS)


def test_prompts_are_deterministic(tok, prompts):
    for fam, ps in prompts.items():
        again = H.make_prompt(ps[1].kind, ps[1].haystack, ps[1].placement, 1, tok, TOKENS)
        assert again == ps[1], fam
        assert ps[0].content != ps[1].content, fam  # another prompt of the family is another draw
    other_seed = H.make_prompt("number", "docs", "after", 1, tok, TOKENS, seed=1)
    assert other_seed.content != prompts["number/docs/after"][1].content


def test_answers_occur_exactly_once_and_differ_from_distractors(prompts):
    for fam, ps in prompts.items():
        for p in ps:
            if p.category == "robust":
                assert p.answers == [] and p.kind == "continue"
                continue
            assert p.answers, fam
            for v in p.answers + p.distractors:
                assert p.content.count(v) == 1, (fam, p.index, v)
            assert not set(p.answers) & set(p.distractors), fam
            assert not any(a in d or d in a for a in p.answers for d in p.distractors), fam
            if p.kind == "multi":
                assert len(p.answers) == 3 and len(p.distractors) == 2
            if p.kind in ("kv", "table"):
                assert len(p.distractors) >= 7  # the other rows of the block


def test_question_placement(prompts):
    for fam, ps in prompts.items():
        for p in ps:
            assert p.question and p.content.count(p.question) == 1, fam
            if p.category == "robust":
                assert p.content.startswith(p.question)
            elif p.placement == "before":
                assert p.content.startswith(f"Question: {p.question}\n"), fam
                assert p.content.rsplit("\n", 1)[-1].startswith("Answer the question asked before the"), fam
            else:
                assert p.content.endswith(f"\n\n{p.question}"), fam


def test_facts_sit_in_the_haystack_body(prompts):
    for p in prompts["number/code/after"]:
        line = next(ln for ln in p.content.splitlines() if p.answers[0] in ln)
        assert re.fullmatch(r"[A-Z0-9_]+ = \d{6}", line), line  # a constant assigned once, at column 0
        at = p.content.index(line) / len(p.content)
        assert 0.05 < at < 0.9
    for p in prompts["uuid/config/before"]:
        assert re.search(r"^[a-z_]+: [0-9a-f-]{36}$", p.content, re.M)
    for p in prompts["multi/logs/before"]:
        assert sum("notes[77]" in ln for ln in p.content.splitlines()) == 5


def test_haystacks_are_not_the_training_sources():
    root = H.stdlib_root()
    for f in H.code_files():
        assert f.relative_to(root).parts[0] in ("idlelib", "lib2to3", "turtledemo")
    assert len(H.doc_paragraphs()) > 50 and not any("<" in p and ">" in p and "</" in p for p in H.doc_paragraphs())
    with pytest.raises(ValueError, match="unknown haystack"):
        H.units("essays", __import__("random").Random(0))
    with pytest.raises(ValueError, match="multi needs a haystack"):
        H.make_prompt("multi", "code", "after", 0, byte_tokenizer(), 400)


def test_scoring():
    p = H.Prompt("multi/prose/after", "sensitive", "multi", "prose", "after", 0, "", ["111111", "222222"], [], 8, 0.2)
    assert S.score(p, "The codes are 111111 and 222222.", None) == 100.0
    assert S.score(p, "111111", None) == 50.0
    assert S.score(p, "none", None) == 0.0
    r = H.Prompt("continue/logs/after", "robust", "continue", "logs", "after", 0, "", [], [], 8, 1.0)
    assert S.score(r, "a b c d", "a b c d") == 100.0
    assert S.score(r, "a b", "c d") == 0.0
    assert S.score(r, "a b", None) != S.score(r, "a b", None)  # NaN without the dense reference


def test_variants_parse_and_refuse():
    vs = S.variants(["dense", "elastic", "floor"], ['floor={"fa_floor": 9}'])
    assert [v.name for v in vs] == ["dense", "elastic", "floor"]
    assert vs[0].xargs == {"elastic_force": "all-FA"} and vs[2].server == {"fa_floor": 9}
    assert vs[1].key() != vs[2].key()
    for bad, msg in (("floor", "NAME=JSON"), ("dense={}", "taken"), ("x=[1]", "JSON object"), ("x={", "not JSON")):
        with pytest.raises(ValueError, match=msg):
            S.parse_variant(bad)
    with pytest.raises(ValueError, match="unknown variants"):
        S.variants(["dense", "nope"], [])
    assert [H.family_name(*c) for c in S.select_cells(["number/*"])] == ["number/docs/after", "number/code/after"]
    with pytest.raises(ValueError, match="matches no family"):
        S.select_cells(["nothing/*"])


def test_static_router_margins_are_the_ranks(tmp_path):
    from elastic_vllm.router.checkpoint import load_router
    from elastic_vllm.router.model import decide

    L, Hkv, D = 4, 3, 16
    (tmp_path / "m").mkdir()
    cfg = {"num_hidden_layers": L, "num_attention_heads": 6, "num_key_value_heads": Hkv, "hidden_size": 96,
           "head_dim": D, "model_type": "llama"}  # fmt: skip
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    scores = torch.rand(L, Hkv)
    path = S.static_router(tmp_path / "m", scores, tmp_path / "r")
    router = load_router(path).router
    rank = torch.empty(L * Hkv)
    rank[torch.argsort(scores.flatten())] = torch.arange(L * Hkv, dtype=torch.float32)
    pooled = 20 * torch.randn(5, L, Hkv, D)  # any prompt: pooled keys of SmolLM2's size
    margins = torch.stack([router(layer, pooled[:, layer]) for layer in range(L)], 1)  # [5, L, H, 2]
    margins = margins[..., 1] - margins[..., 0]
    assert torch.allclose(margins, rank.view(L, Hkv).expand(5, L, Hkv), atol=1e-3)
    for n in (0, 1, 5, L * Hkv):
        fa = decide(torch.stack([torch.zeros_like(margins), margins], -1), -S.static_bias(n))
        assert int((~fa).sum()) == 5 * n  # exactly the n lowest-ranked heads SA, on every prompt
        assert bool((~fa[0].flatten()[torch.argsort(scores.flatten())[:n]]).all())
    with pytest.raises(ValueError, match="do not match"):
        S.static_router(tmp_path / "m", torch.rand(L, Hkv + 1), tmp_path / "r2")


def _rows(fam, cat, variant, found, omega, n=4, n_sa=None):
    return [
        {
            "variant": variant,
            "variant_key": "k",
            "family": fam,
            "category": cat,
            "index": i,
            "prompt_hash": f"{fam}{i}",
            "score": 100.0 * f if cat == "sensitive" else 80.0,
            "found": bool(f) if cat == "sensitive" else None,
            "omega_msr": omega,
            "n_sa": n_sa,
        }
        for i, f in enumerate(found[:n])
    ]


def test_aggregate_targets_and_value_over_static(monkeypatch):
    monkeypatch.setattr(S, "prompt_hash", lambda p: f"{p.family}{p.index}")
    monkeypatch.setattr(S.Variant, "key", lambda self: "k")
    mk = lambda fam, cat: [H.Prompt(fam, cat, "x", "h", "after", i, "", [], [], 8, 0.5) for i in range(4)]  # noqa: E731
    prompts = mk("a", "sensitive") + mk("b", "sensitive") + mk("c", "robust")
    rows = (_rows("a", "sensitive", "dense", [1, 1, 1, 1], 0.0) + _rows("a", "sensitive", "elastic", [1, 1, 1, 0], 0.9)
            + _rows("b", "sensitive", "dense", [1, 0, 0, 0], 0.0) + _rows("b", "sensitive", "elastic", [0, 0, 0, 0], 0.9)
            + _rows("c", "robust", "dense", [0] * 4, 0.0) + _rows("c", "robust", "elastic", [0] * 4, 0.5)
            + _rows("a", "sensitive", "static", [1, 1, 1, 1], 0.7, n_sa=63)
            + _rows("a", "sensitive", "static", [1, 1, 0, 0], 0.9, n_sa=81))  # fmt: skip
    static = {"heads": 90, "by_variant": {"elastic": {"n_sa_by_family": {"a": 81, "c": 45}, "omega_mix": 0.7,
                                                       "n_sa_mix": 63}}}  # fmt: skip
    vs = S.variants(["dense", "elastic"], [])
    res = S.aggregate(rows, prompts, vs, static, {"a"}, {"a": 100.0, "b": 25.0})
    fa = res["families"]["a"]["variants"]
    assert fa["elastic"]["found"] == 75.0 and fa["elastic"]["omega_msr"] == pytest.approx(0.9)
    assert fa["static@elastic"]["found"] == 50.0 and fa["static@elastic"]["n_sa"] == 81
    assert fa["static@elastic-mix"]["found"] == 100.0
    assert not res["families"]["b"]["qualified"]
    t = res["targets"]["elastic"]
    assert set(t["sensitive"]) == {"a"} and not t["sensitive"]["a"]["met"]
    assert (
        "75% of dense < 95%" in t["sensitive"]["a"]["miss"] and "below 90% by 15 points" in t["sensitive"]["a"]["miss"]
    )
    assert t["robust_omega_msr"] == pytest.approx(0.5) and not t["robust_met"]
    v = res["value_over_static"]["elastic"]
    assert v["value"] == pytest.approx(-25.0) and v["static_omega"] == pytest.approx(0.7) and not v["met"]
    res.update(provenance={"vllm": "x", "torch": "t", "gpu": "none", "processor": "p", "host_cpu_count": 2,
                           "git_commit": "abc", "git_dirty": False, "command": "c"},
               model="m", router="r", options={"prompt_tokens": 10}, variants={"dense": {}, "elastic": {}},
               static=static, wall_s=1.0)  # fmt: skip
    md = S.markdown(res)
    assert "| a | 4 | 100 / 0.00 | 75 / 0.90 | 50 / 0.90 | MISSED" in md
    assert "not counted: dense 25% < 70%" in md and "-25.0 points" in md


@pytest.mark.slow
def test_slice_end_to_end_through_real_servers(tmp_path):
    """A number-in-docs family and the logs continuation, 2 prompts each, through `elastic-vllm serve` (the shipped
    router; the static ranking's own server), then --resume adds a variant without re-running the others."""
    scores = torch.arange(90, dtype=torch.float32).view(30, 3).flip(0)  # any fixed ranking: the test checks routing
    (tmp_path / "scores.json").write_text(json.dumps({"retrieval_scores": scores.tolist()}))
    out = tmp_path / "out"
    argv = ["--suite", "generalization", "--slice", "number/docs/after", "continue/logs/after", "--per-cell", "2",
            "--prompt-tokens", "900", "--min-dense", "0", "--static-scores", str(tmp_path / "scores.json"),
            "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert harness.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["families"]) == {"number/docs/after", "continue/logs/after"}
    with gzip.open(out / "samples.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    dense = [r for r in rows if r["variant"] == "dense"]
    assert len(dense) == 4 and all(r["omega_msr"] == 0.0 for r in dense)
    elastic = [r for r in rows if r["variant"] == "elastic"]
    assert len(elastic) == 4 and all(0.0 <= r["omega_msr"] <= 1.0 for r in elastic)
    static = [r for r in rows if r["variant"] == "static"]
    assert static and all(r["omega_msr"] == pytest.approx(r["n_sa"] / 90, abs=1e-6) for r in static)
    plan = res["static"]["by_variant"]["elastic"]
    for fam, n in plan["n_sa_by_family"].items():
        got = res["families"][fam]["variants"]
        assert n == round(got["elastic"]["omega_msr"] * 90)
        if res["families"][fam]["category"] == "sensitive":
            assert got["static@elastic"]["omega_msr"] == pytest.approx(n / 90, abs=1e-6)
        else:  # the robust families' static runs only with --static-robust
            assert "static@elastic" not in got
    assert res["value_over_static"]["elastic"]["static_omega"] == pytest.approx(plan["n_sa_mix"] / 90)
    d = res["families"]["continue/logs/after"]["variants"]["dense"]
    assert d["score"] == 100.0  # dense is its own robust reference
    assert "--suite generalization" in res["provenance"]["command"] and res["provenance"]["vllm"]
    assert (out / "generalization.png").stat().st_size > 0
    assert "| number/docs/after | 2 |" in (out / "results.md").read_text()
    # a new variant on the committed samples: only its requests run (sa_margin 1e3: every head FA)
    logs: list[str] = []
    again = [*argv, "--resume", "--variants", "dense", "wide", "--variant", 'wide={"sa_margin": 1000}']
    opts = __import__("argparse").ArgumentParser()
    harness.add_args(opts)
    harness.run(opts.parse_args(again), ["test"], log=logs.append)
    assert not any("dense: starting a server" in x for x in logs)
    assert any("wide: starting a server for 4 requests" in x for x in logs)
    res = json.loads((out / "results.json").read_text())
    w = res["families"]["number/docs/after"]["variants"]["wide"]
    assert w["omega_msr"] == 0.0 and w["n"] == 2
