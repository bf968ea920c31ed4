"""Deployment-like task families of the router mixture (builder version 3), and the generalization split.

Why one file of ~590 lines: the grid's generators (kind x haystack x form) draw from one seeded ``Families``
and its shared haystacks; split, they would pass that state around.

The first mixture (7 tasks, one prompt format each) taught the router its formats, not "this prompt
needs retrieval": on a needle prompt unlike them it sent 95% of the heads to SA. Here every sample is a
point of a grid, drawn from a seed::

    kind      what is asked: sensitive (number, word, uuid, identifier, kv, json, table_lookup,
              multi_needle, multi_hop, var_track, doc_qa) or robust (continue, rewrite, summary,
              translate, codegen, open_chat)
    haystack  what the long context is: prose, code, logs, config, chat, docs, table
    form      where the question / instruction sits: after the context, before it, in the system
              prompt, or in a later turn of a multi-turn conversation
    template  how the turns become text: the model's chat template, or plain "User:/Assistant:",
              Alpaca "### Instruction:" or Llama-2 "[INST]" text (rendered here, stored as ``prompt``)

A **family** is ``haystack/form``. :data:`HELD_OUT` families never appear in training (neither split of
the mixture): the generalization split (:func:`build_generalization`) holds only them, built from the
eval share of the source items, so a router scored on it meets formats it was never trained on while
every single axis value was seen in other combinations.

Every generated haystack (logs, config, chat, table) is synthetic; prose, code and docs come from the
mixture's sources (``sources.py``): essays and State of the Union addresses, the Python standard
library, the Linux kernel documentation. Translation uses the ISO country names of ``pycountry``
(iso-codes' gettext catalogs) when it is installed.
"""

from __future__ import annotations

import gettext
import json
import random
import re
import uuid
from collections.abc import Callable

SENSITIVE_KINDS: tuple[str, ...] = (
    "number",
    "word",
    "uuid",
    "identifier",
    "kv",
    "json",
    "table_lookup",
    "multi_needle",
    "multi_hop",
    "var_track",
    "doc_qa",
)
ROBUST_KINDS: tuple[str, ...] = ("continue", "rewrite", "summary", "translate", "codegen", "open_chat")
HAYSTACKS: tuple[str, ...] = ("prose", "code", "logs", "config", "chat", "docs", "table")
# builder version 4 (balanced.py) adds the haystacks of the 7 first tasks that the grid lacked: SQuAD / HotpotQA
# paragraphs (squad_qa, hotpot_qa) and RULER's repeated filler sentences (a fifth of the needles' haystacks)
V4_HAYSTACKS: tuple[str, ...] = (*HAYSTACKS, "wiki", "filler")
FORMS: tuple[str, ...] = ("after", "before", "system", "multiturn")
TEMPLATES: tuple[str, ...] = ("model", "plain", "alpaca", "llama2")
# families (haystack/form) kept out of training; each haystack and each form still appears in training
# in other combinations (a test checks it), so these measure composition, not an unseen axis value
HELD_OUT: frozenset[str] = frozenset(
    {"logs/system", "table/before", "chat/after", "docs/multiturn", "code/system", "config/before", "prose/system"}
)
# kinds that only make sense over some haystacks
KIND_HAYSTACKS: dict[str, tuple[str, ...]] = {
    "table_lookup": ("table",),
    "doc_qa": ("prose", "docs"),
    "summary": ("docs", "code"),
    "codegen": ("code",),
}

ADJ = "amber azure brisk calm crimson dusty eager faint gentle golden hollow icy jolly keen lively misty".split()
NOUN = "anchor badger canyon dolphin ember falcon glacier harbor island jungle kettle lantern meadow nectar".split()
WORDS = (
    "apricot basalt cobalt driftwood emerald fjord garnet hazel indigo juniper kestrel lilac marble nutmeg "
    "obsidian paprika quince rosewood sapphire thistle umber verbena wisteria yarrow zinnia"
).split()
PEOPLE = "Alice Bruno Chen Dana Emeka Farah Goran Hana Ivan Jun Kofi Lena Marco Noor Olga Pavel".split()
SERVICES = "auth billing cache gateway indexer mailer scheduler search storage worker".split()
CITIES = "Oslo Lima Pune Kyoto Accra Quito Porto Dakar Hanoi Perth Tartu Cusco".split()
LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")
LOG_MSGS = (
    "request {id} served in {ms} ms",
    "cache miss for key {id}",
    "retrying connection to {svc} (attempt {n})",
    "user {id} logged in from {ip}",
    "flushed {n} records to disk",
    "job {id} finished with status ok",
    "slow query on table {tbl}: {ms} ms",
    "health check passed",
    "rotated log file {tbl}.log",
    "queue depth {n}",
)
LANGS = {"fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "nl": "Dutch", "pt": "Portuguese"}

# question wordings per kind: several each, so the router cannot key on one phrasing
ASK: dict[str, tuple[str, ...]] = {
    "number": (
        "What is the {key}? Answer with the number only.",
        "Find the {key} mentioned in the text and reply with it.",
        "Which number is given as the {key}?",
        "Tell me the {key}.",
    ),
    "word": (
        "What is the {key}? Answer with one word.",
        "Which word was chosen as the {key}?",
        "Look up the {key} and give it.",
    ),
    "uuid": (
        "What is the {key}? Give the identifier only.",
        "Return the UUID recorded as the {key}.",
    ),
    "identifier": (
        "What is the name of the {key}? Reply with the identifier.",
        "Which identifier is the {key}?",
    ),
    "kv": (
        "What value is stored under the key {key}?",
        "Give the value for {key}.",
        "Look up {key}: what is its value?",
    ),
    "json": (
        "In the JSON record of {key}, what is the value of the field {field}?",
        "What does the {field} field of {key} say?",
    ),
    "table_lookup": (
        "What is the {field} of {key} in the table?",
        "According to the table, which {field} does {key} have?",
    ),
    "multi_needle": (
        "List every {key} mentioned in the text.",
        "What are all the values given for the {key}? List them all.",
    ),
    "multi_hop": (
        "{name} keeps the key to one locker. What is the code of that locker?",
        "Which code opens the locker whose key {name} has?",
    ),
    "var_track": (
        "Which variables end up equal to {value}? List all of them.",
        "Find all variables that are assigned the value {value}, directly or through another variable.",
    ),
}
INTROS = (
    "Read the following {what} carefully.",
    "Below is a {what}.",
    "Here is a {what} for you to work with.",
    "I am sharing a {what}.",
    "",
)
WHAT = {
    "prose": "text",
    "code": "source file",
    "logs": "server log",
    "config": "configuration file",
    "chat": "chat transcript",
    "docs": "piece of documentation",
    "table": "table",
    "wiki": "set of encyclopedia paragraphs",
    "filler": "text",
}


def family(haystack: str, form: str) -> str:
    return f"{haystack}/{form}"


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")


def render(template: str, messages: list[dict], tokenizer) -> str | None:
    """The prompt text of ``messages`` in ``template``; None for "model" (the tokenizer renders it)."""
    if template == "model":
        return None
    sys_ = " ".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"]
    if template == "plain":
        head = f"System: {sys_}\n\n" if sys_ else ""
        body = "".join(f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}\n\n" for m in turns)
        return head + body + "Assistant:"
    if template == "alpaca":
        out = f"{sys_}\n\n" if sys_ else "Below is an instruction that describes a task. Write a response.\n\n"
        for m in turns:
            out += f"### {'Instruction' if m['role'] == 'user' else 'Response'}:\n{m['content']}\n\n"
        return out + "### Response:\n"
    if template == "llama2":
        out, first = "", True
        for m in turns:
            if m["role"] == "user":
                s = f"<<SYS>>\n{sys_}\n<</SYS>>\n\n" if first and sys_ else ""
                out += f"[INST] {s}{m['content']} [/INST]"
                first = False
            else:
                out += f" {m['content']} "
        return out
    raise ValueError(f"unknown template {template!r} (known: {', '.join(TEMPLATES)})")


# the instructions of the robust kinds whose body is a builder's sample (one drawn per sample)
ASKS = {
    "summary": (
        "Write a short summary of what this document covers, as its opening paragraph.",
        "Summarize the material above in a few sentences.",
        "What is this about? Give a brief overview.",
    ),
    "codegen": (
        "Write the next lines of the last function.",
        "Continue the code where it stops.",
        "Complete the implementation.",
    ),
}


class Families:
    """Draws family samples for one split; ``builder`` (train.build.Builder) gives sources and token counts."""

    def __init__(self, builder):
        self.b = builder
        # builder version 4: the source a haystack draws from (prose: essays | sotu, wiki: squad | hotpot), so
        # that both samples of a pair read the same source; None draws it (version 3)
        self.source: str | None = None

    # --- haystack units: each a line or sentence of its kind; ``gen`` draws the next one --------------
    def units(self, rng: random.Random, hay: str) -> Callable[[], str]:
        b = self.b
        if hay == "prose":
            if self.source is None:
                docs = [t for _, t in b.sotu()] if rng.random() < 0.4 else b.essays()
            else:
                docs = [t for _, t in b.sotu()] if self.source == "sotu" else b.essays()
            return self._sentences(rng, docs or b.essays() or [t for _, t in b.sotu()])
        if hay == "wiki":
            paras = b.squad()[1] if self.source == "squad" else b.hotpot_paragraphs()
            return self._chunks(rng, paras)
        if hay == "filler":
            sents = [x.strip() + "." for x in RULER_NOISE.split(".") if x.strip()]
            at = [rng.randrange(len(sents))]

            def noise() -> str:
                at[0] += 1
                return sents[at[0] % len(sents)]

            return noise
        if hay == "docs":
            files = b.linuxdoc()
            if files:
                return self._lines(rng, lambda: rng.choice(files).read_text(errors="replace"))
            return self._lines(rng, lambda: _docstrings(rng.choice(b.stdlib_files()).read_text(errors="replace")))
        if hay == "code":
            files = b.stdlib_files()
            return self._lines(rng, lambda: rng.choice(files).read_text(errors="replace"))
        if hay == "logs":
            t = [rng.randrange(86400)]

            def log() -> str:
                t[0] += rng.randint(0, 9)
                h, m, s = t[0] // 3600 % 24, t[0] // 60 % 60, t[0] % 60
                msg = rng.choice(LOG_MSGS).format(
                    id=f"{rng.getrandbits(32):08x}",
                    ms=rng.randint(1, 900),
                    svc=rng.choice(SERVICES),
                    n=rng.randint(1, 9),
                    ip=f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}",
                    tbl=rng.choice(WORDS),
                )
                return f"2025-03-{rng.randint(10, 28)} {h:02d}:{m:02d}:{s:02d} {rng.choice(LEVELS):5} [{rng.choice(SERVICES)}] {msg}"

            return log
        if hay == "config":
            state = {"n": 0}

            def conf() -> str:
                state["n"] += 1
                if state["n"] % 7 == 1:
                    return f"\n[{rng.choice(SERVICES)}.{rng.choice(WORDS)}]"
                k = f"{rng.choice(WORDS)}_{rng.choice(('timeout', 'limit', 'path', 'enabled', 'size', 'retries', 'mode'))}"
                v = rng.choice((str(rng.randint(1, 5000)), "true", "false", f'"/var/lib/{rng.choice(WORDS)}"'))
                return f"{k} = {v}"

            return conf
        if hay == "chat":
            say = self._sentences(rng, b.essays() or [t for _, t in b.sotu()])
            names = rng.sample(PEOPLE, 3)
            return lambda: f"[{rng.randint(8, 20):02d}:{rng.randrange(60):02d}] {rng.choice(names)}: {say().strip()}"
        if hay == "table":
            return lambda: _row(rng, f"{rng.choice(WORDS)}-{rng.randint(100, 999)}")
        raise ValueError(f"unknown haystack {hay!r}")

    @staticmethod
    def _sentences(rng: random.Random, docs: list[str]) -> Callable[[], str]:
        buf: list[str] = []

        def nxt() -> str:
            if not buf:
                doc = rng.choice(docs).replace("\n", " ")
                sents = [x.strip() + "." for x in doc.split(". ") if x.strip()]
                at = rng.randrange(max(1, len(sents) - 40))
                buf.extend(reversed(sents[at : at + 40]))
            return buf.pop()

        return nxt

    @staticmethod
    def _lines(rng: random.Random, text: Callable[[], str]) -> Callable[[], str]:
        buf: list[str] = []

        def nxt() -> str:
            while not buf:
                lines = [ln for ln in text().splitlines() if ln.strip()]
                at = rng.randrange(max(1, len(lines) - 60))
                buf.extend(reversed(lines[at : at + 60]))
            return buf.pop()

        return nxt

    @staticmethod
    def _chunks(rng: random.Random, paras: list[str]) -> Callable[[], str]:
        """Random paragraphs, each cut at sentence ends into pieces of at most 400 characters (a unit's limit)."""
        buf: list[str] = []

        def nxt() -> str:
            if not buf:
                out = [""]
                for sent in re.split(r"(?<=[.!?])\s+", rng.choice(paras).replace("\n", " ").strip()):
                    if out[-1] and len(out[-1]) + len(sent) > 380:
                        out.append("")
                    out[-1] += sent + " "
                buf.extend(reversed([x.strip() for x in out if x.strip()]))
            return buf.pop()

        return nxt

    def haystack(self, rng: random.Random, hay: str, budget: int) -> list[str]:
        """Units of ``hay`` of about ``budget`` tokens in all (counted per unit)."""
        gen = self.units(rng, hay)
        out, used = [], 0
        if hay == "table":
            out, used = [TABLE_HEAD], self.b.ntok(TABLE_HEAD)
        while used < budget:
            u = gen()[:400]
            used += self.b.ntok(u) + 1
            out.append(u)
        return out

    # --- needles: a fact written in the haystack's own style ------------------------------------------
    @staticmethod
    def fact_unit(hay: str, sentence: str, key: str, value: str, rng: random.Random) -> str:
        if hay == "code":
            return f'{slug(key).upper()} = "{value}"  # {sentence}' if value and rng.random() < 0.5 else f"# {sentence}"
        if hay == "logs":
            return f"2025-03-{rng.randint(10, 28)} {rng.randrange(24):02d}:{rng.randrange(60):02d}:00 INFO  [{rng.choice(SERVICES)}] note: {sentence}"
        if hay == "config":
            return f"# {sentence}\n{slug(key)} = {value}" if value else f"# {sentence}"
        if hay == "chat":
            return f"[{rng.randint(8, 20):02d}:{rng.randrange(60):02d}] {rng.choice(PEOPLE)}: {sentence}"
        if hay == "table":
            return _row(rng, key, note=sentence)
        return sentence

    @staticmethod
    def insert(rng: random.Random, units: list[str], needles: list[str], keep_head: int = 0) -> list[str]:
        """``needles`` at random places among ``units`` (in order), never before ``keep_head``."""
        out = list(units)
        spots = sorted(rng.randint(keep_head, len(out)) for _ in needles)
        for k, (at, nd) in enumerate(zip(spots, needles)):
            out.insert(at + k, nd)
        return out

    def sensitive(self, rng: random.Random, kind: str, hay: str) -> tuple[list[str], str, str, str]:
        """(context units, question, answer, source) of a retrieval sample."""
        b = self.b
        budget = b.budget(rng, 24)
        src = f"synthetic-{hay}"
        if kind == "doc_qa":
            items, _paras = b.squad()
            qid, q, ans, gold = rng.choice(items)
            units = self.haystack(rng, hay, budget - b.ntok(gold))
            return self.insert(rng, units, [gold]), q, ans, f"squad-v2-dev:{qid}+{hay}"
        if kind in ("number", "word", "uuid", "identifier", "multi_needle"):
            thing = f"{rng.choice(ADJ)} {rng.choice(NOUN)}"
            key = rng.choice(
                (f"access code of the {thing} account", f"secret number for {thing}", f"pin of the {thing} vault")
            )
            if kind == "word":
                key = rng.choice((f"password of the {thing} locker", f"code word for the {thing} project"))
            if kind == "uuid":
                key = f"request id of the {thing} incident"
            if kind == "identifier":
                key = rng.choice((f"function that validates the {thing} input", f"class behind the {thing} feature"))
            n = rng.randint(2, 4) if kind == "multi_needle" else 1
            vals = [self._value(rng, kind) for _ in range(n)]
            needles = [(key, v) for v in vals]
            # distractors: facts of the same shape about other things
            for _ in range(rng.randint(0, 3)):
                other = f"{rng.choice(ADJ)} {rng.choice(NOUN)}"
                if other != thing:
                    needles.append((key.replace(thing, other), self._value(rng, kind)))
            rng.shuffle(needles)
            facts = [self.fact_unit(hay, f"The {k} is {v}.", k, v, rng) for k, v in needles]
            units = self.haystack(rng, hay, budget - sum(b.ntok(f) for f in facts))
            q = rng.choice(ASK["multi_needle" if kind == "multi_needle" else kind]).format(key=key)
            return self.insert(rng, units, facts), q, ", ".join(vals), src
        if kind == "kv":
            pairs = {
                f"{rng.choice(WORDS)}-{rng.randint(1000, 9999)}": str(rng.randint(10_000, 99_999)) for _ in range(40)
            }
            keys = list(pairs)
            block = [f"{k}: {v}" if hay != "config" else f"{slug(k)} = {v}" for k, v in pairs.items()]
            units = self.haystack(rng, hay, budget - sum(b.ntok(x) for x in block))
            key = rng.choice(keys)
            q = rng.choice(ASK["kv"]).format(key=key if hay != "config" else slug(key))
            return self.insert(rng, units, ["\n".join(block)]), q, pairs[key], src
        if kind == "json":
            recs = {
                f"{rng.choice(PEOPLE)} {rng.choice(NOUN).title()}": {
                    "city": rng.choice(CITIES),
                    "badge": str(rng.randint(100000, 999999)),
                    "team": rng.choice(WORDS),
                }
                for _ in range(12)
            }
            name = rng.choice(list(recs))
            field = rng.choice(("city", "badge", "team"))
            block = json.dumps(recs, indent=1)
            units = self.haystack(rng, hay, budget - b.ntok(block))
            q = rng.choice(ASK["json"]).format(key=name, field=field)
            return self.insert(rng, units, [block]), q, recs[name][field], src
        if kind == "table_lookup":
            units = self.haystack(rng, "table", budget)
            at = rng.randrange(1, len(units))
            cells = [c.strip() for c in units[at].strip("|").split("|")]
            field = rng.choice(("city", "owner", "amount"))
            col = {"city": 1, "owner": 2, "amount": 3}[field]
            q = rng.choice(ASK["table_lookup"]).format(key=cells[0], field=field)
            return units, q, cells[col], src
        if kind == "multi_hop":
            name, other = rng.sample(PEOPLE, 2)
            locker, decoy = rng.sample(range(10, 99), 2)
            code, dcode = (str(rng.randint(100000, 999999)) for _ in range(2))
            facts = [
                f"{name} was given the key to locker {locker}.",
                f"{other} was given the key to locker {decoy}.",
                f"Locker {locker} opens with the code {code}.",
                f"Locker {decoy} opens with the code {dcode}.",
            ]
            rng.shuffle(facts)
            facts = [self.fact_unit(hay, s, f"locker {i}", "", rng) for i, s in enumerate(facts)]
            units = self.haystack(rng, hay, budget - sum(b.ntok(f) for f in facts))
            return self.insert(rng, units, facts), rng.choice(ASK["multi_hop"]).format(name=name), code, src
        if kind == "var_track":
            value = str(rng.randint(10000, 99999))
            names = [f"VAR_{''.join(rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ') for _ in range(4))}" for _ in range(4)]
            chain = [f"{names[0]} = {value}"] + [f"{names[i]} = {names[i - 1]}" for i in range(1, len(names))]
            decoy = (
                f"VAR_{''.join(rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ') for _ in range(4))} = {rng.randint(10000, 99999)}"
            )
            stmts = [*chain, decoy]
            units = self.haystack(rng, hay, budget - sum(b.ntok(s) for s in stmts))
            q = rng.choice(ASK["var_track"]).format(value=value)
            return self.insert(rng, units, stmts), q, ", ".join(names), src
        raise ValueError(f"unknown sensitive kind {kind!r}")

    @staticmethod
    def _value(rng: random.Random, kind: str) -> str:
        if kind == "word":
            return rng.choice(WORDS)
        if kind == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if kind == "identifier":
            return (
                rng.choice(("validate", "parse", "load", "check")) + "_" + rng.choice(WORDS) + f"_v{rng.randint(2, 9)}"
            )
        return str(rng.randint(100000, 9999999))

    def robust(self, rng: random.Random, kind: str, hay: str) -> tuple[list[str], str, str, str]:
        """(context units, instruction, answer, source) of a sample that local context answers."""
        b = self.b
        budget = b.budget(rng, 96)
        src = f"synthetic-{hay}"
        if kind == "summary":
            r = b._summarize_rst(rng, b.linuxdoc()) if hay == "docs" and b.linuxdoc() else None
            r = r or b._summarize_module(rng)
            body = r["content"].split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
            return [body], rng.choice(ASKS[kind]), r["answer"], r["source"]
        if kind == "codegen":
            r = b.code_completion(rng)
            return [r["content"].split("\n\n", 1)[1]], rng.choice(ASKS[kind]), r["answer"], r["source"]
        if kind == "continue":
            units = self.haystack(rng, hay, budget)
            n_ans = rng.randint(2, 4)  # the haystack's own next units: real text or the same generator's
            units, ans = units[:-n_ans], units[-n_ans:]
            ask = rng.choice(
                ("Continue from where it stops.", "Write what comes next.", "Keep going: add the next few lines.")
            )
            return units, ask, "\n".join(ans), src
        if kind == "rewrite":
            units = self.haystack(rng, hay, budget)
            last, what = units[-1], "sentence" if hay in ("prose", "filler") else "line"
            how = rng.choice(("upper", "reverse", "quote"))
            ask, ans = {
                "upper": (f"Rewrite the last {what} in capital letters.", last.upper()),
                "reverse": (f"Write the words of the last {what} in reverse order.", " ".join(reversed(last.split()))),
                "quote": (f"Repeat the last {what} exactly, in double quotes.", f'"{last}"'),
            }[how]
            return units, ask, ans, src
        if kind == "translate":
            pairs = country_names(rng.choice(sorted(LANGS)))
            if not pairs:  # pycountry missing: an open question instead
                return self.robust(rng, "open_chat", hay)
            lang = pairs[0][2]
            en, tr = rng.choice(pairs[1:])[:2]
            units = self.haystack(rng, hay, budget)
            return (
                units,
                f'Translate "{en}" into {LANGS[lang]}. Reply with the translation only.',
                tr,
                f"iso-codes:{lang}",
            )
        if kind == "open_chat":
            item = rng.choice(b.hotpot())
            units = self.haystack(rng, hay, budget)
            return units, f"Unrelated question: {item['question']}", item["answer"], f"hotpotqa-dev:{item['_id']}"
        raise ValueError(f"unknown robust kind {kind!r}")

    # --- a whole sample ------------------------------------------------------------------------------
    def messages(
        self, rng: random.Random, hay: str, form: str, context: str, question: str, category: str
    ) -> list[dict]:
        intro = rng.choice(INTROS).format(what=WHAT[hay])
        if form == "after":
            return [{"role": "user", "content": f"{intro}\n\n{context}\n\n{question}".lstrip()}]
        if form == "before":
            lead = rng.choice(("{q}\n\n", "Question: {q}\n\n", "{q} Use the {w} below.\n\n"))
            return [{"role": "user", "content": lead.format(q=question, w=WHAT[hay]) + context}]
        if form == "system":
            role = (
                "You answer questions about the material the user sends."
                if category == "sensitive"
                else "You are a helpful assistant working on the material the user sends."
            )
            return [
                {"role": "system", "content": f"{role} Task: {question}"},
                {"role": "user", "content": f"{intro}\n\n{context}".lstrip()},
            ]
        if form == "multiturn":
            msgs = []
            if rng.random() < 0.5:  # an earlier, unrelated exchange
                msgs += [
                    {"role": "user", "content": rng.choice(("Hi! Can you help me today?", "Good morning."))},
                    {"role": "assistant", "content": "Of course. What do you need?"},
                ]
            msgs += [
                {"role": "user", "content": f"{intro}\n\n{context}".lstrip()},
                {
                    "role": "assistant",
                    "content": rng.choice(("Got it.", "I have read it. What would you like to know?")),
                },
                {"role": "user", "content": question},
            ]
            return msgs
        raise ValueError(f"unknown form {form!r}")

    def sample(
        self, rng: random.Random, category: str, families: tuple[str, ...], kinds: tuple[str, ...] | None = None
    ) -> dict:
        """One sample of ``category`` from one of ``families`` (haystack/form)."""
        kinds = kinds or (SENSITIVE_KINDS if category == "sensitive" else ROBUST_KINDS)
        for _ in range(50):
            fam = rng.choice(families)
            hay, form = fam.split("/")
            ok = [k for k in kinds if hay in KIND_HAYSTACKS.get(k, HAYSTACKS)]
            if ok:
                break
        else:
            raise RuntimeError(f"no {category} kind fits the families {families}")
        return self.compose(rng, category, rng.choice(ok), hay, form)

    def sample_at(
        self, rng: random.Random, category: str, hay: str, form: str, template: str, source: str | None
    ) -> dict:
        """One sample of ``category`` with the haystack (and its source), form and template given (version 4)."""
        kinds = SENSITIVE_KINDS if category == "sensitive" else ROBUST_KINDS
        ok = [k for k in kinds if hay in KIND_HAYSTACKS.get(k, V4_HAYSTACKS)]
        if not ok:
            raise ValueError(f"no {category} kind fits the haystack {hay!r}")
        self.source = source
        return self.compose(rng, category, rng.choice(ok), hay, form, template)

    def compose(
        self, rng: random.Random, category: str, kind: str, hay: str, form: str, template: str | None = None
    ) -> dict:
        make = self.sensitive if category == "sensitive" else self.robust
        units, question, answer, source = make(rng, kind, hay)
        context = " ".join(units) if hay in ("prose", "filler") else "\n".join(units)
        msgs = self.messages(rng, hay, form, context, question, category)
        template = template or rng.choice(TEMPLATES)
        return {
            "messages": msgs,
            "prompt": render(template, msgs, self.b.tok),
            "answer": answer,
            "source": source,
            "family": family(hay, form),
            "kind": kind,
            "template": template,
        }


# RULER's filler haystack (niah with noise): the same five sentences over and over
RULER_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TABLE_HEAD = "| id | city | owner | amount | status |\n|---|---|---|---|---|"


def _row(rng: random.Random, key: str, note: str = "") -> str:
    status = note or rng.choice(("open", "closed", "pending", "shipped"))
    return f"| {key} | {rng.choice(CITIES)} | {rng.choice(PEOPLE)} | {rng.randint(10, 99999)} | {status} |"


def _docstrings(src: str) -> str:
    return "\n".join(m.strip() for m in re.findall(r'"""(.*?)"""', src, flags=re.S))


_COUNTRIES: dict[str, list] = {}


def country_names(lang: str) -> list:
    """[(lang header), (English name, translated name, lang), ...] from pycountry's iso3166-1 catalog; [] without it."""
    if lang in _COUNTRIES:
        return _COUNTRIES[lang]
    try:
        import pycountry
    except ImportError:
        _COUNTRIES[lang] = []
        return []
    t = gettext.translation("iso3166-1", pycountry.LOCALES_DIR, languages=[lang], fallback=True)
    rows = [(c.name, t.gettext(c.name), lang) for c in sorted(pycountry.countries, key=lambda c: c.alpha_2)]
    rows = [r for r in rows if r[1] != r[0]]
    _COUNTRIES[lang] = [("", "", lang), *rows] if rows else []
    return _COUNTRIES[lang]


def train_families() -> tuple[str, ...]:
    return tuple(family(h, f) for h in HAYSTACKS for f in FORMS if family(h, f) not in HELD_OUT)


def held_out_families() -> tuple[str, ...]:
    return tuple(sorted(HELD_OUT))
