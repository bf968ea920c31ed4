"""RULER generation through NVIDIA's generators (tiny length, demo tokenizer) and the committed data files."""

import json
from pathlib import Path

import pytest

from elastic_vllm.eval.ruler import (
    MARK,
    RULER_TASKS,
    RulerError,
    format_prompt,
    generate_ruler,
    read_jsonl,
    split_marked,
    task_configs,
    write_jsonl,
)

DATA = Path(__file__).resolve().parents[2] / "elastic_vllm" / "eval" / "data"


def test_task_configs_cover_the_13_tasks():
    cfg = task_configs()
    assert list(cfg) == list(RULER_TASKS) and len(cfg) == 13
    assert cfg["qa_2"]["metric"] == "string_match_part"
    assert cfg["niah_multivalue"]["metric"] == "string_match_all"
    assert cfg["niah_multivalue"]["args"]["num_needle_v"] == 4
    assert cfg["vt"]["tokens_to_generate"] == 30


def test_split_marked_keeps_one_shot_examples_as_ruler_writes_them():
    text = f"Example list.\nQuestion: top words?{MARK} Answer: a b c\nReal list.\nQuestion: top words?{MARK} Answer:"
    user, prefix = split_marked(text)
    assert user == "Example list.\nQuestion: top words? Answer: a b c\nReal list.\nQuestion: top words?"
    assert prefix == " Answer:"
    with pytest.raises(RulerError):
        split_marked("no marker")


@pytest.mark.slow  # needs the demo model (its tokenizer)
def test_generate_niah_essay_with_demo_tokenizer(demo_model_dir, tmp_path):
    """niah_single_2 (essay haystack: exercises nltk's fallback splitter) at 1024 tokens, 2 samples."""
    from transformers import AutoTokenizer

    out = generate_ruler(demo_model_dir, [1024], 2, tmp_path / "r.jsonl.xz", tasks=["niah_single_2"], seed=7)
    rows = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    assert [r["index"] for r in rows] == [0, 1]
    for r in rows:
        assert r["task"] == "niah_single_2" and r["length"] == 1024 and r["metric"] == "string_match_all"
        assert len(r["outputs"]) == 1 and r["outputs"][0].isdigit() and len(r["outputs"][0]) == 7
        assert r["outputs"][0] in r["input"]  # the needle is in the haystack
        assert MARK not in r["input"]
        # chat template, then RULER's answer prefix opening the assistant turn
        assert r["input"].startswith("<|im_start|>system")
        assert r["input"].endswith("<|im_start|>assistant\n" + r["answer_prefix"])
        assert r["answer_prefix"].startswith("The special magic number for") and r["answer_prefix"].endswith("is")
        n = len(tok.encode(r["input"], add_special_tokens=False))
        assert n == r["prompt_tokens"] and n + r["tokens_to_generate"] <= 1024
    assert rows[0]["input"] != rows[1]["input"]
    with pytest.raises(RulerError, match="unknown RULER tasks"):
        generate_ruler(demo_model_dir, [1024], 1, tmp_path / "x.jsonl", tasks=["niah_single_9"])


def test_format_prompt_base_mode_is_rulers_text():
    assert format_prompt(None, "Question?", " Answer:", chat=False) == "Question? Answer:"


def test_jsonl_roundtrip_compressed(tmp_path):
    rows = [{"a": 1, "s": "é\n"}, {"a": 2}]
    for name in ("x.jsonl", "x.jsonl.gz", "x.jsonl.xz"):
        assert read_jsonl(write_jsonl(tmp_path / name, rows)) == rows


def test_committed_data_files():
    """The files the GPU run reads: counts as the manifest says, prompts within their length, small."""
    manifest = json.loads((DATA / "smollm2_manifest.json").read_text())
    total = 0
    for kind in ("ruler", "robust"):
        info = manifest["files"][kind]
        path = DATA / info["path"]
        total += path.stat().st_size
        rows = read_jsonl(path)
        counts: dict[str, int] = {}
        for r in rows:
            counts[f"{r['task']}@{r['length']}"] = counts.get(f"{r['task']}@{r['length']}", 0) + 1
            assert {"index", "task", "length", "input", "outputs", "prompt_tokens"} <= set(r)
            assert r["prompt_tokens"] <= r["length"], (r["task"], r["length"], r["prompt_tokens"])
        assert counts == info["records"]
    ruler = manifest["files"]["ruler"]["records"]
    assert {f"{t}@{n}" for t in RULER_TASKS for n in (4096, 8192)} <= set(ruler)
    assert total < 8 * 2**20
