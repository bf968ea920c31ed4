"""The mixture builder (deterministic, split-disjoint, length-bounded) on small stand-in sources,
and the training-side reading of its rows (chat template, prompt/answer split, stratified order)."""

import gzip
import json
from collections import Counter
from pathlib import Path

from elastic_vllm.hf.testing import byte_tokenizer
from elastic_vllm.train.build import TASKS, build, split_rst, strip_module_docstring
from elastic_vllm.train.data import end_of_turn, load_examples, read_jsonl, sample_order, tokenize

SAMPLE = Path(__file__).resolve().parents[2] / "elastic_vllm" / "train" / "data" / "sample.jsonl"


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
