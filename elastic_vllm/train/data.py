"""Training examples: read the mixture JSONL, apply the chat template, order the samples.

A JSONL line (written by ``elastic_vllm.train.build``)::

    {"task": "squad_qa", "category": "sensitive", "messages": [{"role": "user", "content": ...}],
     "answer": "Denver Broncos", "source": "...", "id": "..."}

Tokens = template(messages, generation prompt) + answer + the template's end of turn. The router
pools over the prompt part only; the LM loss counts the answer part only. The prompt is tokenized
alone, exactly as it is at inference.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elastic_vllm.train.config import CATEGORIES


@dataclass(frozen=True)
class Example:
    task: str
    category: str
    input_ids: tuple[int, ...]
    prompt_len: int
    pair: str | None = None  # builder version 4: the id shared with its partner of the other category

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not JSON ({e})") from None
            for k in ("task", "category", "messages", "answer"):
                if k not in row:
                    raise ValueError(f"{p}:{n}: missing field {k!r}")
            if row["category"] not in CATEGORIES:
                raise ValueError(f"{p}:{n}: category {row['category']!r} not in {CATEGORIES}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{p}: no examples")
    return rows


def end_of_turn(tokenizer) -> str:
    """What the chat template writes after an assistant message's content (e.g. "<|im_end|>")."""
    probe = "\x00PROBE\x00"
    msgs = [{"role": "user", "content": "u"}]
    head = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*msgs, {"role": "assistant", "content": probe}], tokenize=False)
    if full.startswith(head) and probe in full:
        tail = full[full.index(probe) + len(probe) :]
        return tail.rstrip("\n") or (tokenizer.eos_token or "")
    return tokenizer.eos_token or ""


def prompt_text(row: dict, tokenizer) -> str:
    """The prompt as the model reads it: ``prompt`` when the row was rendered in another template
    (builder version 3, ``families.render``), else the tokenizer's chat template of ``messages``."""
    if row.get("prompt"):
        return row["prompt"]
    return tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)


def tokenize(row: dict, tokenizer, eot: str | None = None) -> Example:
    prompt = prompt_text(row, tokenizer)
    p_ids = tokenizer.encode(prompt, add_special_tokens=False)
    a_ids = tokenizer.encode(row["answer"] + (end_of_turn(tokenizer) if eot is None else eot), add_special_tokens=False)
    if not a_ids:
        raise ValueError(f"empty answer in task {row['task']}")
    return Example(row["task"], row["category"], tuple(p_ids + a_ids), len(p_ids), row.get("pair"))


def load_examples(path: str | Path, tokenizer, max_tokens: int) -> tuple[list[Example], int]:
    """Tokenized examples of at most ``max_tokens`` tokens, and how many longer ones were skipped."""
    eot = end_of_turn(tokenizer)
    out, skipped = [], 0
    for row in read_jsonl(path):
        ex = tokenize(row, tokenizer, eot)
        if ex.num_tokens > max_tokens:
            skipped += 1
            continue
        out.append(ex)
    if not out:
        raise ValueError(f"{path}: every example is longer than max_tokens={max_tokens}")
    return out, skipped


def sample_order(examples: list[Example], seed: int) -> Iterator[int]:
    """Endless deterministic stream of example indices, stratified by task, or by pair when every example has one.

    By task: each epoch shuffles every task's list, then deals them round-robin (task order reshuffled each
    round), so any window of ~#tasks consecutive samples covers every task. Tasks with fewer
    examples simply run out earlier in the epoch.

    By pair (builder version 4): each epoch shuffles the pairs and deals both partners back to back, so every
    window of the stream, not only a whole epoch, holds as many sensitive as robust samples of each haystack
    (by task, a version-4 mixture's 240 first-task samples on SQuAD/HotpotQA paragraphs would come in the
    epoch's first rounds and their robust partners, dealt as one task of 600, mostly later).
    """
    if all(ex.pair is not None for ex in examples):
        yield from _pair_order(examples, seed)
        return
    by_task: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        by_task.setdefault(ex.task, []).append(i)
    tasks = sorted(by_task)
    epoch = 0
    while True:
        rng = random.Random(seed * 1_000_003 + epoch)
        lists = {t: rng.sample(by_task[t], len(by_task[t])) for t in tasks}
        while any(lists.values()):
            order = [t for t in tasks if lists[t]]
            rng.shuffle(order)
            for t in order:
                yield lists[t].pop()
        epoch += 1


def _pair_order(examples: list[Example], seed: int) -> Iterator[int]:
    by_pair: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        by_pair.setdefault(ex.pair, []).append(i)  # type: ignore[arg-type]
    pairs = sorted(by_pair)
    epoch = 0
    while True:
        rng = random.Random(seed * 1_000_003 + epoch)
        for p in rng.sample(pairs, len(pairs)):
            yield from rng.sample(by_pair[p], len(by_pair[p]))
        epoch += 1
