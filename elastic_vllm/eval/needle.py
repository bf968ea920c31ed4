"""Needle-in-a-haystack prompts (RULER niah_single style), built deterministically offline.

A 6-digit "special magic number" is hidden at a chosen depth of a haystack; the question at
the end asks for it. Haystacks: ``noise`` (RULER's repeated filler sentences) or any text file
(e.g. an essay); the prompt is cut to about ``n_tokens`` tokens with the model's tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ["apple", "river", "candle", "falcon", "granite", "meadow", "harbor", "velvet", "saffron", "quartz"]


@dataclass(frozen=True)
class NeedlePrompt:
    messages: list[dict[str, str]]
    answer: str
    key: str
    answer_prefix: str  # appended after the chat template's generation prompt (RULER does the same)

    def text(self, tokenizer) -> str:
        """The full prompt string: chat template + generation prompt + answer prefix."""
        head = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        return head + self.answer_prefix


def _haystack_units(haystack: str | Path) -> list[str]:
    if haystack == "noise":
        return [NOISE]
    text = Path(haystack).read_text(errors="replace")
    sents = [s.strip() + ". " for s in text.replace("\n", " ").split(". ") if s.strip()]
    if not sents:
        raise ValueError(f"haystack file {haystack} has no text")
    return sents


def make_needle_prompt(
    tokenizer, n_tokens: int, depth: float = 0.5, seed: int = 0, haystack: str | Path = "noise"
) -> NeedlePrompt:
    """A chat prompt of about ``n_tokens`` tokens (chat template included) with one needle."""
    rng = random.Random(seed)
    key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
    value = str(rng.randint(100000, 999999))
    needle = f" One of the special magic numbers for {key} is: {value}. "
    question = f"What is the special magic number for {key} mentioned in the provided text?"
    units = _haystack_units(haystack)
    # grow the haystack until the templated prompt reaches n_tokens
    overhead = len(tokenizer.encode(needle + question)) + 40
    budget = max(n_tokens - overhead, 16)
    pieces: list[str] = []
    used = 0
    i = 0
    while used < budget:
        u = units[i % len(units)]
        pieces.append(u)
        used += len(tokenizer.encode(u, add_special_tokens=False))
        i += 1
    at = round(depth * len(pieces))
    body = "".join(pieces[:at]) + needle + "".join(pieces[at:])
    content = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n" + body + "\n" + question
    )
    prefix = f"The special magic number for {key} mentioned in the provided text is"
    return NeedlePrompt(messages=[{"role": "user", "content": content}], answer=value, key=key, answer_prefix=prefix)
