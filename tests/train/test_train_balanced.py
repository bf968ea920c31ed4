"""Builder version 4 (balanced.py) on the stand-in sources: the haystack cannot predict the label (every sample
has a partner of the other category on its haystack, source, form and template), the manifest shows it, the same
seed gives the same bytes, train and eval share no source item, and the served evaluation's held-out haystacks
(elastic_vllm/eval/heldout.py) never reach training."""

import random
import re
import shutil
from collections import Counter

import pytest

from elastic_vllm.eval import heldout
from elastic_vllm.hf.testing import byte_tokenizer
from elastic_vllm.train.balanced import LEGACY_TASKS, balance, build_balanced, legacy_haystack, majority_accuracy
from elastic_vllm.train.data import prompt_text, read_jsonl, sample_order, tokenize
from elastic_vllm.train.families import HELD_OUT, V4_HAYSTACKS

LEAK = "HELDOUT_LEAK_MARKER"
# the served evaluation's generated haystacks, by their line formats (heldout.units): syslog lines, IRC chat,
# YAML sections, the fictional region's prose; training writes its logs, chat and config in other formats
HELDOUT_FORMATS = {
    "logs": re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ [\w/]+\[\d+\]: ", re.M),
    "chat": re.compile(r"\[\d\d:\d\d\] <\w+> "),
    "config": re.compile(r"^\w+_(service|cache|queue|store|proxy):\n  \w+: ", re.M),
    "prose": re.compile(r"\b(" + "|".join(heldout.PLACES) + r")\b"),
}


# what each haystack source of the stand-ins writes into a prompt (prose and docs have no marker of their own)
SOURCE_MARKERS = {
    "wiki:squad": r"The keeper of hall",
    "wiki:hotpot": r"Title \d+-\d+",
    "code:stdlib": r"return x \+",
    "filler:ruler-noise": r"The grass is green",
    "logs:generated": r"2025-03-\d\d \d\d:\d\d:\d\d",
    "config:generated": r"(?m)^\w+ = ",
    "table:generated": r"\| \w+-\d+ \|",
}


@pytest.fixture(scope="module")
def stdlib_with_heldout(sources, tmp_path_factory):
    """The stand-in standard library plus the packages the served evaluation reads (idlelib, lib2to3, turtledemo,
    IDLE's help.html), each full of a marker that must never appear in a training row."""
    root = tmp_path_factory.mktemp("stdlib")
    shutil.copytree(sources / "stdlib", root, dirs_exist_ok=True)
    body = "".join(f"def {LEAK.lower()}_{j}(x):\n    return '{LEAK}' * {j}\n\n\n" for j in range(60))
    for pkg in ("idlelib", "lib2to3", "turtledemo"):
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text(f'"""{LEAK} package {pkg}: helpers of the held-out code."""\n{body}')
        (root / pkg / "more.py").write_text(body)
    (root / "idlelib" / "help.html").write_text(f"<html><body><p>IDLE is Python's {LEAK} editor.</p></body></html>")
    return root


def _build(sources, stdlib, out, seed=0):
    return build_balanced(
        out, byte_tokenizer(), sources, per_task=2, eval_per_task=1, pairs=14, min_tokens=300, max_tokens=1500,
        seed=seed, progress=False, stdlib=stdlib,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mix(sources, stdlib_with_heldout, tmp_path_factory):
    out = tmp_path_factory.mktemp("mix4")
    return out, _build(sources, stdlib_with_heldout, out)


def test_haystack_cannot_predict_the_label(mix):
    out, m = mix
    assert m["builder_version"] == 4 and m["legacy_tasks"] == list(LEGACY_TASKS)
    for split in ("train", "eval"):
        rows = read_jsonl(out / f"{split}.jsonl.gz")
        b = m["balance"][split]
        assert b == balance(rows)  # the manifest shows what was written
        assert not b["unbalanced_pairs"]
        for key in ("haystack", "haystack_source", "form", "template", "haystack_source+form+template"):
            assert b["predictor_accuracy"][key] <= 0.55, (split, key, b["predictor_accuracy"])
        counts = Counter((r["haystack"], r["category"]) for r in rows)
        for hay in {r["haystack"] for r in rows}:
            assert counts[(hay, "sensitive")] == counts[(hay, "robust")] > 0, (split, hay)
    train = read_jsonl(out / "train.jsonl.gz")
    # every haystack kind (the first tasks' wiki paragraphs and filler too), both labels each
    assert {r["haystack"] for r in train} == set(V4_HAYSTACKS)
    assert Counter(r["task"] for r in train if r["task"] in LEGACY_TASKS) == {t: 2 for t in LEGACY_TASKS}
    # each first-task sample's partner comes from its own source: SQuAD paragraphs for squad_qa, and so on
    tok = byte_tokenizer()
    for r in train:
        if r["task"] in LEGACY_TASKS:
            assert (r["haystack"], r["haystack_source"], r["form"]) == legacy_haystack(r)
        else:
            assert r["family"] == f"{r['haystack']}/{r['form']}"
        marker = SOURCE_MARKERS.get(f"{r['haystack']}:{r['haystack_source']}")
        assert marker is None or re.search(marker, prompt_text(r, tok)), (r["pair"], r["task"], r["haystack_source"])


def test_balance_statistic_detects_a_confounded_mixture():
    rows = [{"category": c, "haystack": h} for c, h in [("sensitive", "prose")] * 3 + [("robust", "code")] * 3]
    assert majority_accuracy(rows, lambda r: r["haystack"]) == 1.0
    rows += [{"category": "robust", "haystack": "prose"}] * 3 + [{"category": "sensitive", "haystack": "code"}] * 3
    assert majority_accuracy(rows, lambda r: r["haystack"]) == 0.5


def test_same_seed_same_bytes(sources, stdlib_with_heldout, mix, tmp_path):
    _, m = mix
    assert _build(sources, stdlib_with_heldout, tmp_path / "again")["files"] == m["files"]
    assert _build(sources, stdlib_with_heldout, tmp_path / "seed1", seed=1)["files"] != m["files"]


def test_train_and_eval_share_no_source_item(mix):
    out, _ = mix
    train, ev = (read_jsonl(out / f"{s}.jsonl.gz") for s in ("train", "eval"))

    def items(rows):
        # the stand-ins' SQuAD paragraphs name their keeper (Mira<article><paragraph>), HotpotQA's their title
        text = "\n".join(prompt_text(r, byte_tokenizer()) + r["answer"] for r in rows)
        return set(re.findall(r"\bMira\d+\b", text)) | set(re.findall(r"\bTitle \d+-\d+\b", text))

    qa = lambda rows: {r["source"] for r in rows if r["source"].startswith(("squad", "hotpot"))}  # noqa: E731
    assert items(train) and items(ev) and not items(train) & items(ev)
    assert not qa(train) & qa(ev)


def test_served_heldout_haystacks_do_not_leak(mix):
    out, _ = mix
    rows = read_jsonl(out / "train.jsonl.gz") + read_jsonl(out / "eval.jsonl.gz")
    tok = byte_tokenizer()
    text = "\n".join(prompt_text(r, tok) + r["answer"] + r["source"] for r in rows)
    assert "pkg/mod" in text  # the stand-in standard library is read ...
    assert LEAK not in text and "idlelib" not in text and "lib2to3" not in text  # ... the held-out packages are not
    assert not {r.get("family") for r in rows} & HELD_OUT
    for hay, pattern in HELDOUT_FORMATS.items():
        gen = heldout.units(hay, random.Random(0))
        assert all(pattern.search(gen()) for _ in range(5)), hay  # the pattern recognizes the held-out format
        assert not pattern.search(text), hay


def test_rows_are_what_the_trainer_reads(mix):
    out, _ = mix
    tok = byte_tokenizer()
    rows = read_jsonl(out / "train.jsonl.gz")
    for r in rows:
        assert r["tokens"] <= 1500 and r["answer"].strip()
        assert abs(tokenize(r, tok).num_tokens - r["tokens"]) <= 2
    # by pair: both partners back to back, every window of the stream balanced
    examples = [tokenize(r, tok) for r in rows]
    stream = sample_order(examples, seed=0)
    first = [next(stream) for _ in range(2 * len(rows))]
    assert sorted(first[: len(rows)]) == list(range(len(rows)))  # an epoch is every example once
    for a, b in zip(first[::2], first[1::2]):
        assert examples[a].pair == examples[b].pair and {examples[a].category, examples[b].category} == {
            "sensitive",
            "robust",
        }


def test_version_4_rejects_tasks_without_a_partner(sources, tmp_path):
    with pytest.raises(ValueError, match=r"builder version 4: tasks \['icl_classify'\] have no partner"):
        build_balanced(tmp_path, byte_tokenizer(), sources, tasks=("squad_qa", "icl_classify"), progress=False)
    with pytest.raises(ValueError, match="maps to no haystack"):
        legacy_haystack({"task": "needle", "source": "somewhere-else+synthetic-needles:style0"})


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--task-counts", "retrieval=10"], "--version 4 balances the counts itself"),
        (["--generalization", "4"], "the generalization split does not depend on the version"),
        (["--pairs", "-1"], "--pairs must be >= 0"),
        (["--tasks", "needle,local"], r"tasks \['local'\] have no partner"),
    ],
)
def test_cli_version_4_names_what_it_cannot_do(sources, tmp_path, extra, match):
    import argparse

    from elastic_vllm.train.cli import build_data_args as add_build_args
    from elastic_vllm.train.cli import build_from_args

    p = argparse.ArgumentParser()
    add_build_args(p)
    a = p.parse_args(["--out", str(tmp_path / "o"), "--version", "4", "--sources", str(sources), "--no-fetch", *extra])
    a.tokenizer = None
    with pytest.raises(ValueError, match=match):
        build_from_args(a)
