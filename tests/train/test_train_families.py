"""Builder version 3: the deployment-like families (families.py) and the generalization split, on the
small stand-in sources of test_train_data.py: deterministic from the seed, every axis covered, no
held-out family in training, answers present in the prompts of the retrieval kinds."""

import random
from collections import Counter

import pytest

from elastic_vllm.hf.testing import byte_tokenizer
from elastic_vllm.train.build import Builder, build, build_generalization
from elastic_vllm.train.cli import parse_task_counts
from elastic_vllm.train.data import prompt_text, read_jsonl, tokenize
from elastic_vllm.train.families import (
    FORMS,
    HAYSTACKS,
    HELD_OUT,
    KIND_HAYSTACKS,
    ROBUST_KINDS,
    SENSITIVE_KINDS,
    TEMPLATES,
    Families,
    held_out_families,
    render,
    train_families,
)


def _builder(sources, split="train", seed=0):
    return Builder(sources, byte_tokenizer(), seed, 300, 1500, split, sources / "stdlib")


def test_every_axis_value_is_trained_in_some_family():
    fams = train_families()
    assert not set(fams) & HELD_OUT
    assert {f.split("/")[0] for f in fams} == set(HAYSTACKS)
    assert {f.split("/")[1] for f in fams} == set(FORMS)
    assert set(held_out_families()) == HELD_OUT and len(fams) + len(HELD_OUT) == len(HAYSTACKS) * len(FORMS)


@pytest.mark.parametrize("kind", SENSITIVE_KINDS)
def test_retrieval_kinds_put_the_answer_in_the_context(sources, kind):
    fam = Families(_builder(sources))
    for i, hay in enumerate(KIND_HAYSTACKS.get(kind, HAYSTACKS)):
        rng = random.Random(f"t:{kind}:{i}")
        units, question, answer, source = fam.sensitive(rng, kind, hay)
        ctx = "\n".join(units)
        assert question and answer and source
        for part in answer.split(", "):  # every value (multi_needle), every variable (var_track)
            assert part in ctx, (kind, hay, part)


@pytest.mark.parametrize("kind", ROBUST_KINDS)
def test_robust_kinds_build_over_their_haystacks(sources, kind):
    fam = Families(_builder(sources))
    for i, hay in enumerate(KIND_HAYSTACKS.get(kind, HAYSTACKS)):
        units, ask, answer, source = fam.robust(random.Random(f"r:{kind}:{i}"), kind, hay)
        assert units and ask and answer.strip() and source


def test_templates_and_forms_place_the_question():
    tok = byte_tokenizer()
    msgs = [{"role": "system", "content": "SYS Q"}, {"role": "user", "content": "CTX"}]
    assert render("model", msgs, tok) is None
    plain = render("plain", msgs, tok)
    assert plain.startswith("System: SYS Q") and plain.endswith("Assistant:")
    assert render("alpaca", msgs, tok).endswith("### Response:\n")
    assert render("llama2", msgs, tok).startswith("[INST] <<SYS>>\nSYS Q\n<</SYS>>")
    with pytest.raises(ValueError, match="unknown template"):
        render("nope", msgs, tok)
    fam = Families(None)
    rng = random.Random(0)
    after = fam.messages(rng, "logs", "after", "CTX", "Q?", "sensitive")
    assert after[-1]["content"].endswith("CTX\n\nQ?")
    before = fam.messages(rng, "logs", "before", "CTX", "Q?", "sensitive")
    assert before[-1]["content"].endswith("CTX") and "Q?" in before[-1]["content"]
    system = fam.messages(rng, "logs", "system", "CTX", "Q?", "sensitive")
    assert system[0]["role"] == "system" and "Q?" in system[0]["content"] and "Q?" not in system[1]["content"]
    multi = fam.messages(rng, "logs", "multiturn", "CTX", "Q?", "sensitive")
    assert multi[-1] == {"role": "user", "content": "Q?"} and multi[-2]["role"] == "assistant"


def test_mixture_v3_deterministic_covering_and_never_held_out(sources, tmp_path):
    def b(out, seed=0):
        return build(
            out, byte_tokenizer(), sources, per_task=2, eval_per_task=1, min_tokens=300, max_tokens=1500,
            seed=seed, progress=False, stdlib=sources / "stdlib", tasks=("needle", "retrieval", "local"),
            task_counts={"retrieval": 60, "local": 40},
        )  # fmt: skip

    m1, m2 = b(tmp_path / "a"), b(tmp_path / "b")
    assert m1["files"] == m2["files"] and m1["builder_version"] == 3
    assert b(tmp_path / "c", seed=1)["files"] != m1["files"]
    rows = read_jsonl(tmp_path / "a" / "train.jsonl.gz")
    assert Counter(r["task"] for r in rows) == {"needle": 2, "retrieval": 60, "local": 40}
    fam = [r for r in rows if r["task"] != "needle"]
    assert not {r["family"] for r in fam} & HELD_OUT
    assert {r["kind"] for r in fam if r["category"] == "sensitive"} == set(SENSITIVE_KINDS)
    assert {r["kind"] for r in fam if r["category"] == "robust"} >= set(ROBUST_KINDS) - {"translate"}
    assert {r["template"] for r in fam} == set(TEMPLATES)
    assert {r["family"].split("/")[1] for r in fam} == set(FORMS)
    tok = byte_tokenizer()
    for r in fam:
        assert r["tokens"] <= 1500
        assert ("prompt" in r) == (r["template"] != "model")
        assert abs(tokenize(r, tok).num_tokens - r["tokens"]) <= 2  # the trainer reads what was measured
        if r["template"] != "model":
            assert prompt_text(r, tok) == r["prompt"]
    assert "train_families" in m1["splits"] and m1["held_out_families"] == sorted(HELD_OUT)


def test_generalization_split_is_held_out_only(sources, tmp_path):
    m = build_generalization(
        tmp_path / "g", byte_tokenizer(), sources, per_family=2, min_tokens=300, max_tokens=1500,
        stdlib=sources / "stdlib",
    )  # fmt: skip
    rows = read_jsonl(tmp_path / "g" / "generalization.jsonl.gz")
    assert Counter((r["family"], r["category"]) for r in rows) == {
        (f, c): 2 for f in HELD_OUT for c in ("sensitive", "robust")
    }
    assert all(r["split"] == "generalization" for r in rows)
    # every family draws its own samples (one seed for all gave every family the same sample)
    first = [(r["kind"], r["answer"]) for r in rows if r["category"] == "sensitive"][::2]
    assert len(set(first)) > len(first) // 2
    again = build_generalization(
        tmp_path / "h", byte_tokenizer(), sources, per_family=2, min_tokens=300, max_tokens=1500,
        stdlib=sources / "stdlib",
    )  # fmt: skip
    assert again["files"] == m["files"]


def test_task_counts_are_validated():
    assert parse_task_counts("retrieval=3, local=0") == {"retrieval": 3, "local": 0}
    with pytest.raises(ValueError, match="--task-counts: unknown task 'x'"):
        parse_task_counts("x=1")
    with pytest.raises(ValueError, match="--task-counts: local needs a count"):
        parse_task_counts("local=-1")
