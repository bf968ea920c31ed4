"""The mixture builder (deterministic, split-disjoint, length-bounded) on small stand-in sources,
and the training-side reading of its rows (chat template, prompt/answer split, stratified order)."""

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from elastic_vllm.hf.testing import byte_tokenizer
from elastic_vllm.train.build import TASKS, build, split_rst, strip_module_docstring
from elastic_vllm.train.data import end_of_turn, load_examples, read_jsonl, sample_order, tokenize

SAMPLE = Path(__file__).resolve().parent.parent / "elastic_vllm" / "train" / "data" / "sample.jsonl"
WORDS = "alpha beta gamma delta river stone cloud field light paper window garden".split()


def _sentences(rng, n):
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(8)).capitalize() + "." for _ in range(n))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Same layout and formats as the fetched sources, a few KB each."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("sources")
    lce = root / "lce"
    lce.mkdir()
    squad = {"version": "v2.0", "data": []}
    for a in range(20):
        paras = []
        for p in range(3):
            ctx = _sentences(rng, 3) + f" The keeper of hall {a}-{p} is Mira{a}{p}."
            qas = [{"id": f"q{a}{p}", "question": f"Who keeps hall {a}-{p}?", "answers": [{"text": f"Mira{a}{p}"}]}]
            paras.append({"context": ctx, "qas": qas})
        squad["data"].append({"title": f"Article {a}", "paragraphs": paras})
    (lce / "squad.json").write_text(json.dumps(squad))
    hotpot = []
    for i in range(40):
        ctx = [[f"Title {i}-{j}", [_sentences(rng, 2)]] for j in range(4)]
        kind = "comparison" if i % 3 == 0 else "bridge"
        hotpot.append(
            {
                "_id": f"h{i}",
                "question": f"Question {i} about {rng.choice(WORDS)}?",
                "answer": f"ans{i}",
                "context": ctx,
                "type": kind,
            }
        )
    (lce / "hotpotqa.json").write_text(json.dumps(hotpot))
    essays = "".join(f"{m} 20{10 + i}" + _sentences(rng, 40) for i, m in enumerate(["March", "May", "June"] * 4))
    (lce / "PaulGrahamEssays.json").write_text(json.dumps({"text": essays}))
    sotu = root / "sotu"
    sotu.mkdir()
    for y in range(1900, 1912):
        (sotu / f"{y}_someone_x.json").write_text(json.dumps({"year": y, "text": _sentences(rng, 60)}))
    rst = root / "linuxdoc" / "rst" / "admin"
    rst.mkdir(parents=True)
    for i in range(12):
        body = "\n\n".join(_sentences(rng, 5) for _ in range(8))
        lead = f"This document describes how the subsystem number {i} works and how to configure it safely."
        (rst / f"doc{i}.rst").write_text(
            f".. _doc{i}:\n\n=========\nDoc {i}\n=========\n\n:Author: X\n\n{lead}\n\n{body}\n"
        )
    std = root / "stdlib" / "pkg"  # stands in for the Python standard library
    std.mkdir(parents=True)
    for i in range(12):
        funcs = "".join(f"def f{j}(x):\n    return x + {j}\n\n\n" for j in range(40))
        (std / f"mod{i}.py").write_text(
            f'"""Helpers number {i}: small functions that add constants to numbers."""\n\n{funcs}'
        )
    return root


def _build(sources, out, seed=0, n=3):
    return build(
        out,
        byte_tokenizer(),
        sources,
        per_task=n,
        eval_per_task=1,
        min_tokens=300,
        max_tokens=1200,
        seed=seed,
        progress=False,
        stdlib=sources / "stdlib",
    )


def test_build_is_deterministic_split_disjoint_and_bounded(sources, tmp_path):
    m1 = _build(sources, tmp_path / "a")
    m2 = _build(sources, tmp_path / "b")
    assert m1["files"] == m2["files"]  # same seed, same bytes
    assert _build(sources, tmp_path / "c", seed=1)["files"] != m1["files"]
    train = read_jsonl(tmp_path / "a" / "train.jsonl.gz")
    ev = read_jsonl(tmp_path / "a" / "eval.jsonl.gz")
    assert Counter(r["task"] for r in train) == {t: 3 for t in TASKS}
    for r in train + ev:
        assert r["category"] == TASKS[r["task"]] and r["answer"] and r["messages"][-1]["role"] == "user"
        assert r["tokens"] <= 1200
    tok = byte_tokenizer()
    for r in train:  # the recorded length is what the trainer will see (+- the end-of-turn token)
        assert abs(tokenize(r, tok).num_tokens - r["tokens"]) <= 2
    # train and eval never share a QA item
    qa = lambda rows: {r["source"] for r in rows if r["task"] in ("squad_qa", "hotpot_qa")}  # noqa: E731
    assert not qa(train) & qa(ev)
    with gzip.open(tmp_path / "a" / "train.jsonl.gz", "rt") as f:
        assert json.loads(f.readline())["split"] == "train"


def test_rst_and_docstring_splitting():
    title, lead, rest = split_rst(
        "=====\nTitle\n=====\n\n:Date: x\n\n" + "Lead sentence that is long. " * 4 + "\n\nBody.\n"
    )
    assert title == "Title" and lead.startswith("Lead sentence") and rest == "Body."
    doc, code = strip_module_docstring('"""Tools for X.\n\nMore text."""\nimport os\n')
    assert doc == "Tools for X." and code == "import os\n"


def test_examples_split_prompt_and_answer_at_the_template():
    tok = byte_tokenizer()
    row = {"task": "t", "category": "robust", "messages": [{"role": "user", "content": "hi"}], "answer": "yo"}
    ex = tokenize(row, tok)
    prompt = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    assert end_of_turn(tok) == "<|im_end|>"
    assert tok.decode(ex.input_ids[: ex.prompt_len]) == prompt
    assert tok.decode(ex.input_ids[ex.prompt_len :]) == "yo<|im_end|>"


def test_sample_order_is_stratified_and_deterministic(tmp_path):
    rows = [
        {"task": t, "category": "robust", "messages": [{"role": "user", "content": "x" * (i + 1)}], "answer": "a"}
        for t in "abc"
        for i in range(5)
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex, skipped = load_examples(p, byte_tokenizer(), max_tokens=30)
    assert skipped == 0
    it = sample_order(ex, 0)
    first = [next(it) for _ in range(15)]
    assert sorted(first) == list(range(15))  # one epoch = every example once
    for k in range(0, 15, 3):
        assert {ex[i].task for i in first[k : k + 3]} == {"a", "b", "c"}
    again = sample_order(ex, 0)
    assert [next(again) for _ in range(15)] == first


def test_committed_sample_of_the_real_mixture():
    """A few rows of the real mixture (built from the fetched sources) are committed for reference."""
    rows = read_jsonl(SAMPLE)
    assert {r["task"] for r in rows} == set(TASKS)
    assert all(r["category"] == TASKS[r["task"]] for r in rows)
