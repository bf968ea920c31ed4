"""Scores of the accuracy harness, all on a 0-100 scale (higher is better).

- ``string_match_all`` / ``string_match_part``: RULER's metrics (``long_context_eval/eval/synthetic/
  constants.py``): the share of reference strings found (case-insensitive) in the prediction, or 100
  if any is found. Predictions are post-processed as RULER does (strip, control characters -> newline).
- ``rouge_l``: ROUGE-L F1 (longest common subsequence over lower-cased alphanumeric tokens, the
  tokenization of the ``rouge_score`` package's default).
- ``edit_similarity``: 1 - Levenshtein(a, b) / max(len a, len b), over characters (LongBench / RepoBench
  "ES" for next-line code completion).
- ``nll_score``: 100 * ppl_dense / ppl = 100 * exp(nll_dense - nll): 100 for the dense model, lower when a
  method's continuation loss is higher.
"""

from __future__ import annotations

import math
import re

_CONTROL = re.compile(r"[\x00-\x1f]")
_TOKEN = re.compile(r"[a-z0-9]+")


def postprocess_pred(text: str | None) -> str:
    """RULER's post-processing: strip, control characters become newlines, strip again."""
    if text is None:
        return ""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(pred: str, refs: list[str]) -> float:
    """100 * share of ``refs`` contained in ``pred`` (case-insensitive)."""
    if not refs:
        raise ValueError("no reference strings")
    p = pred.lower()
    return 100.0 * sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: list[str]) -> float:
    """100 if any of ``refs`` is contained in ``pred`` (case-insensitive), else 0."""
    if not refs:
        raise ValueError("no reference strings")
    p = pred.lower()
    return 100.0 if any(r.lower() in p for r in refs) else 0.0


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def rouge_tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence (O(len a * len b) time, O(len b) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F1 x 100 between two texts (0 when either has no tokens, unless both are empty)."""
    p, r = rouge_tokens(pred), rouge_tokens(ref)
    if not p and not r:
        return 100.0
    if not p or not r:
        return 0.0
    lcs = lcs_length(p, r)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 100.0 * 2 * prec * rec / (prec + rec)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def edit_similarity(pred: str, ref: str) -> float:
    """(1 - Levenshtein / max length) x 100; 100 for two empty strings."""
    n = max(len(pred), len(ref))
    if n == 0:
        return 100.0
    return 100.0 * (1.0 - levenshtein(pred, ref) / n)


def first_code_line(text: str) -> str:
    """The first non-empty line of a completion, stripped (what next-line completion is scored on)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def nll_score(nll: float, nll_dense: float) -> float:
    """100 * exp(nll_dense - nll): the dense model's perplexity over this method's, in percent."""
    return 100.0 * math.exp(nll_dense - nll)
