"""The held-out prompt families of the served generalization suite: (retrieval kind) x (haystack kind) x (question
placement), and a continuation family per haystack kind. Seeded and deterministic; nothing is read from the
router's training sources (``train/DATA.md``).

Haystacks (none of them in the training mixture):

| haystack | text |
|---|---|
| prose | generated: sentences of a fictional region's history, trade and weather from templates |
| code | Python source of the standard library's ``idlelib``, ``lib2to3`` and ``turtledemo`` (the mixture skips them) |
| logs | generated syslog lines (sshd, cron, kernel, nginx, systemd, postfix) |
| config | generated YAML (nested sections of service settings) |
| docs | IDLE's manual as the standard library ships it (``idlelib/help.html``, tags stripped; ``README.txt``) |
| chat | generated IRC-style team chat (``[hh:mm] <nick> ...``) |

Retrieval kinds: ``number`` (6 digits), ``word``, ``uuid``, ``identifier`` (a snake_case function name), ``kv`` (one
of ``KV_PAIRS`` key-value pairs), ``table`` (the port of one service in a ``TABLE_ROWS``-row table), ``multi`` (the
``MULTI_ANSWERS`` values of one key, all asked). Each fact is written in the haystack's own style (a constant
assigned in code, a YAML key, a log line, a chat message, a sentence); every answer value occurs exactly once in
the prompt and differs from every distractor (checked when the prompt is built). The question comes after the
context, or before it and again after it. The sizes are the calibration: with 16 pairs, 8-row tables, 3 values
among distractors or a question asked only before the context, the dense demo model found 0-12% at ~1.2K tokens.

``CELLS`` is the design: 14 of the 42 (kind, haystack) cells, every kind in 2 haystacks and every haystack in 2-3
kinds, both placements, including a 6-digit number in technical documentation and a value assigned once in
Python source (where the shipped router sends ~95% of the heads to SA). Robust families, two per haystack:
``continue`` (the haystack alone, a completions prompt, scored by the loss of its last ``LOSS_TOKENS`` tokens) and
``summarize`` (the haystack in one user turn like the retrieval prompts', asked for a summary; the reply is scored
against dense's reply to the same prompt), so the robust side has chat prompts of the same form as the sensitive
side's, with only the task differing.

Why one file of ~520 lines: the six haystack generators and the seven fact styles are one table each; the prompt
builder reads both.
"""

from __future__ import annotations

import html
import random
import re
import sysconfig
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HAYSTACKS = ("prose", "code", "logs", "config", "docs", "chat")
KINDS = ("number", "word", "uuid", "identifier", "kv", "table", "multi")
PLACEMENTS = ("after", "before")
CELLS: tuple[tuple[str, str, str], ...] = (
    ("number", "docs", "after"),
    ("number", "code", "after"),
    ("identifier", "code", "before"),
    ("identifier", "config", "after"),
    ("word", "prose", "before"),
    ("word", "docs", "after"),
    ("uuid", "config", "before"),
    ("uuid", "prose", "after"),
    ("kv", "chat", "before"),
    ("kv", "logs", "after"),
    ("multi", "logs", "before"),
    ("multi", "chat", "after"),
    ("table", "docs", "before"),
    ("table", "logs", "after"),
)
ROBUST_KINDS = ("continue", "summarize")
ROBUST_CELLS: tuple[tuple[str, str, str], ...] = tuple((k, h, "after") for k in ROBUST_KINDS for h in HAYSTACKS)
WHAT = {
    "prose": "text",
    "code": "Python source file",
    "logs": "system log",
    "config": "YAML configuration file",
    "docs": "piece of documentation",
    "chat": "chat transcript",
}
# new tokens: enough for the answer in a sentence that first repeats the key (a UUID is ~25 tokens, three 6-digit
# values ~20; 24 cut "The constant ACCESS_CODE_..._VAULT is 16909" one digit short)
MAX_TOKENS = {"number": 32, "word": 16, "uuid": 56, "identifier": 40, "kv": 24, "table": 24, "multi": 48}
# robust families: the mean NLL of the prompt's last LOSS_TOKENS tokens given the rest (vLLM's prompt_logprobs)
LOSS_TOKENS = 128
# summaries: greedy reply of at most SUMMARY_TOKENS new tokens to the instruction after the haystack
SUMMARY_TOKENS = 64
SUMMARY_Q = "Summarize the {what} above in two sentences."
KV_PAIRS, TABLE_ROWS, MULTI_ANSWERS, MULTI_OTHER = 8, 5, 2, 0

W = (
    "amber anchor aspen basil birch bramble cedar clover copper coral cypress delta ember fennel fern flint "
    "garnet ginger granite harbor heather hickory indigo iris jasper juniper kelp larch lava linen maple marsh "
    "meadow mica mint moss nickel oak onyx orchid otter pebble pepper pine plum quartz raven reed saffron sage "
    "slate spruce tansy thyme topaz tulip umber walnut willow wren yew zircon"
).split()
ANSWER_WORDS = (
    "tangerine marmalade dumpling porcupine lighthouse trombone snowflake pinecone scarecrow telescope harmonica "
    "pancake mushroom waterfall butterfly cinnamon sunflower kangaroo pineapple volcano avalanche blueberry "
    "caramel dragonfly hedgehog meteorite paperclip raincoat sandcastle toothbrush"
).split()
NICKS = "ada bob cyd dex eli fay gus hal ivy jo kai lou max nia oz pia".split()


# --- haystack sources ---------------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def code_files() -> tuple[Path, ...]:
    root = stdlib_root()
    files = sorted(f for d in ("idlelib", "lib2to3", "turtledemo") for f in (root / d).rglob("*.py"))
    files = tuple(f for f in files if "idle_test" not in f.parts and "tests" not in f.parts)
    if not files:
        raise FileNotFoundError(f"no idlelib / lib2to3 / turtledemo sources under {root} (the code haystack)")
    return files


def strip_html(text: str) -> str:
    text = re.sub(r"<(script|style)[^>]*>.*?</\1>", "", text, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "", text)).replace("\u00b6", "")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text)


@lru_cache(maxsize=1)
def doc_paragraphs() -> tuple[str, ...]:
    root = stdlib_root() / "idlelib"
    page = strip_html((root / "help.html").read_text(errors="replace"))
    at = page.find("IDLE is Python")  # the manual proper, after the page's navigation
    texts = [page[at if at >= 0 else 0 :], (root / "README.txt").read_text(errors="replace")]
    paras = []
    for t in texts:
        for p in re.split(r"\n\s*\n", t):
            p = p.strip()
            if len(p) > 40:
                paras.append(p[:1200])
    return tuple(paras)


PLACES = "Varnholm Eskdale Morrow Tallis Quenby Harwick Ostrava Linden Caddis Brill Fenmoor Aldrin".split()
GOODS = "wool salt timber amber cheese copper glass rope linen honey flax slate".split()
PROSE = (
    "In {year} the people of {P} built a {adj} bridge across the river to reach the {w} market.",
    "Traders from {P} carried {g} and {g2} along the coast road every spring.",
    "The winter of {year} was remembered in {P} for its {adj} storms and the loss of the {w} mill.",
    "Most families in {P} kept goats, and the {w} fields were shared between three villages.",
    "A {adj} tower still stands above the harbour of {P}, though its bell was melted down long ago.",
    "By {year} the price of {g} in {P} had doubled, and many young people left for the cities.",
    "The council of {P} met in the old {w} hall on the first day of every month.",
    "Local stories say that the {w} spring never froze, even in the hardest winters.",
    "Fishing boats from {P} returned each evening with herring, cod and the occasional {adj} shark.",
    "The school in {P} opened in {year} with eleven pupils and a single teacher from {P2}.",
    "Roads between {P} and {P2} were often closed in March when the {w} pass flooded.",
    "Visitors describe the streets of {P} as narrow, {adj} and full of the smell of {g}.",
    "In the autumn the hills around {P} turn {adj}, and the {w} forest fills with mushroom pickers.",
    "A railway line reached {P} in {year}, which made it cheaper to send {g} to {P2}.",
    "The chronicle of {P} records a fire in {year} that destroyed the {w} quarter.",
    "Farmers in {P} grew barley and rye, and in good years they sold {g} to merchants from {P2}.",
)
ADJ = "quiet narrow tall grey windy bright ancient crowded steep golden muddy wooden".split()


def _prose(rng: random.Random) -> Callable[[], str]:
    def para() -> str:
        out = []
        for _ in range(rng.randint(3, 6)):
            p, p2 = rng.sample(PLACES, 2)
            g, g2 = rng.sample(GOODS, 2)
            out.append(
                rng.choice(PROSE).format(
                    year=rng.randint(1620, 1950), P=p, P2=p2, g=g, g2=g2, w=rng.choice(W), adj=rng.choice(ADJ)
                )
            )
        return " ".join(out)

    return para


MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
LOG_MSGS = (
    ("sshd", "Accepted publickey for {user} from 10.{a}.{b}.{c} port {port} ssh2"),
    ("sshd", "Disconnected from user {user} 10.{a}.{b}.{c} port {port}"),
    ("sshd", "Invalid user {user} from 192.168.{a}.{b} port {port}"),
    ("CRON", "({user}) CMD (/usr/local/bin/{w}-sync --quiet)"),
    ("kernel", "[{sec}.{usec}] eth0: link up, 1000 Mbps, full duplex"),
    ("kernel", "[{sec}.{usec}] EXT4-fs (sda{n}): mounted filesystem with ordered data mode"),
    ("nginx", '10.{a}.{b}.{c} - - "GET /api/{w}/{n} HTTP/1.1" 200 {size}'),
    ("nginx", '10.{a}.{b}.{c} - - "POST /upload/{w} HTTP/1.1" 413 {size}'),
    ("systemd", "Started {w}.service - {W} background worker."),
    ("systemd", "{w}-backup.timer: Succeeded."),
    ("postfix/smtpd", "connect from mail{n}.{w}.example[10.{a}.{b}.{c}]"),
    ("postfix/qmgr", "queue active: {n} messages, {size} bytes"),
)


def _logs(rng: random.Random) -> Callable[[], str]:
    t = [rng.randrange(86400 * 20)]
    host = f"{rng.choice(W)}-{rng.randint(1, 9)}"

    def line() -> str:
        t[0] += rng.randint(0, 40)
        day, s = divmod(t[0], 86400)
        proc, msg = rng.choice(LOG_MSGS)
        w = rng.choice(W)
        msg = msg.format(
            user=rng.choice(NICKS), a=rng.randrange(256), b=rng.randrange(256), c=rng.randrange(256),
            port=rng.randint(1024, 65535), sec=rng.randint(10, 99999), usec=rng.randint(100000, 999999),
            n=rng.randint(1, 9), w=w, W=w.capitalize(), size=rng.randint(100, 99999),
        )  # fmt: skip
        stamp = f"{MONTHS[(day // 28) % 12]} {day % 28 + 1:2d} {s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"
        return f"{stamp} {host} {proc}[{rng.randint(200, 32000)}]: {msg}"

    return line


CONF_KEYS = ("host", "port", "timeout_s", "retries", "workers", "enabled", "log_level", "path", "max_conn", "ttl")


def _config(rng: random.Random) -> Callable[[], str]:
    def section() -> str:
        lines = [f"{rng.choice(W)}_{rng.choice(('service', 'cache', 'queue', 'store', 'proxy'))}:"]
        for key in rng.sample(CONF_KEYS, rng.randint(3, 6)):
            v = {
                "host": f"{rng.choice(W)}.internal",
                "port": str(rng.randint(1024, 9999)),
                "timeout_s": str(rng.choice((5, 10, 30, 60))),
                "retries": str(rng.randint(0, 5)),
                "workers": str(rng.choice((1, 2, 4, 8))),
                "enabled": rng.choice(("true", "false")),
                "log_level": rng.choice(("debug", "info", "warning")),
                "path": f"/var/lib/{rng.choice(W)}",
                "max_conn": str(rng.choice((64, 128, 256))),
                "ttl": f"{rng.randint(1, 48)}h",
            }[key]
            lines.append(f"  {key}: {v}")
        return "\n".join(lines)

    return section


CHAT = (
    "did anyone look at the {w} build yet?",
    "I pushed a fix for the {w} tests, can someone review?",
    "the {w} dashboard is slow again",
    "lunch in ten minutes?",
    "I'll be out tomorrow afternoon",
    "{n}: can you restart the {w} worker when you have a sec",
    "merged, thanks!",
    "the deploy to {w} finished without errors",
    "who owns the {w} alerts these days?",
    "I think the flaky test is in the {w} module",
    "ok, rebasing now",
    "standup moved to 10:30",
    "the {w} migration needs one more approval",
    "nice catch",
    "disk on {w}-{k} is at {p}%, cleaning up old logs",
    "does anyone have the link to the {w} design doc?",
)


def _chat(rng: random.Random) -> Callable[[], str]:
    nicks = rng.sample(NICKS, 5)
    t = [rng.randint(8 * 60, 11 * 60)]

    def line() -> str:
        t[0] += rng.randint(0, 3)
        msg = rng.choice(CHAT).format(w=rng.choice(W), n=rng.choice(nicks), k=rng.randint(1, 9), p=rng.randint(80, 99))
        return f"[{t[0] // 60 % 24:02d}:{t[0] % 60:02d}] <{rng.choice(nicks)}> {msg}"

    return line


def _from_lines(rng: random.Random, texts: Callable[[], str], block: int = 80) -> Callable[[], str]:
    buf: list[str] = []

    def nxt() -> str:
        while not buf:
            lines = [ln.rstrip() for ln in texts().splitlines() if ln.strip()]
            at = rng.randrange(max(1, len(lines) - block))
            buf.extend(reversed(lines[at : at + block]))
        return buf.pop()

    return nxt


def units(hay: str, rng: random.Random) -> Callable[[], str]:
    """A generator of the haystack's units (lines; paragraphs for prose and docs; sections for config)."""
    if hay == "prose":
        return _prose(rng)
    if hay == "code":
        files = code_files()
        return _from_lines(rng, lambda: rng.choice(files).read_text(errors="replace"))
    if hay == "logs":
        return _logs(rng)
    if hay == "config":
        return _config(rng)
    if hay == "docs":
        paras = doc_paragraphs()
        start = [rng.randrange(len(paras))]

        def para() -> str:  # consecutive paragraphs, as one reads a manual
            start[0] = (start[0] + 1) % len(paras)
            return paras[start[0]]

        return para
    if hay == "chat":
        return _chat(rng)
    raise ValueError(f"unknown haystack {hay!r}; known: {', '.join(HAYSTACKS)}")


SEP = {"prose": "\n\n", "docs": "\n\n", "config": "\n", "code": "\n", "logs": "\n", "chat": "\n"}


# --- facts in the haystack's own style ------------------------------------------------------------------------------
def snake(key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", key.lower().replace(" of the ", " ")).strip("_")


def fact(hay: str, key: str, value: str, rng: random.Random, quote: bool = False) -> str:
    """One statement "the ``key`` is ``value``" as a unit of ``hay``."""
    if hay == "code":
        v = f'"{value}"' if quote else value
        return f"{snake(key).upper()} = {v}"
    if hay == "config":
        return f"{snake(key)}: {value}"
    the = f"the {key}"
    if hay == "logs":
        s = rng.randrange(86400)
        return f"{rng.choice(MONTHS)} {rng.randint(1, 28):2d} {s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d} ops-1 notes[77]: {the} is {value}"
    if hay == "chat":
        return f"[{rng.randint(8, 17):02d}:{rng.randrange(60):02d}] <{rng.choice(NICKS)}> fyi, {the} is {value}"
    if hay == "docs":
        return f"Note: {the} is {value}."
    return f"{the[0].upper()}{the[1:]} is {value}."


def ask_name(hay: str, key: str, quoted: bool = False) -> str:
    """How the question names the key: the constant in code (the string assigned to it, for a quoted value: asked
    for "the constant", the demo model explains the constant), the YAML key in config, the words elsewhere."""
    if hay == "code":
        return f"the string assigned to {snake(key).upper()}" if quoted else f"the constant {snake(key).upper()}"
    return f"the key {snake(key)}" if hay == "config" else f"the {key}"


def kv_block(hay: str, pairs: list[tuple[str, str]], rng: random.Random) -> list[str]:
    if hay == "config":
        return [f"{rng.choice(W)}_limits:"] + [f"  {k}: {v}" for k, v in pairs]
    if hay == "code":
        return ["LIMITS = {"] + [f'    "{k}": {v},' for k, v in pairs] + ["}"]
    if hay == "chat":
        head = (
            f"[{rng.randint(8, 17):02d}:{rng.randrange(60):02d}] <{rng.choice(NICKS)}> current limits, for the record:"
        )
        return [head] + [f"    {k} = {v}" for k, v in pairs]
    if hay == "logs":
        return [f"Mar  3 04:00:0{i % 10} ops-1 limits[91]: {k}={v}" for i, (k, v) in enumerate(pairs)]
    return ["Limits:"] + [f"{k}: {v}" for k, v in pairs]


def table_block(hay: str, rows: list[tuple[str, str, str]]) -> list[str]:
    head = ("service", "port", "owner")
    if hay == "logs":  # a status report printed into the log, fixed-width
        return ["inventory[12]: service   port   owner"] + [f"inventory[12]: {h:<9} {p:<6} {o}" for h, p, o in rows]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


# --- prompts --------------------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    family: str
    category: str  # sensitive / robust
    kind: str
    haystack: str
    placement: str
    index: int
    content: str  # the user message
    answers: list[str]  # values to find (sensitive); empty for robust
    distractors: list[str]
    max_tokens: int
    depth: float  # where the (first) fact sits in the haystack, 0-1
    question: str = ""
    loss_tokens: int = 0  # robust: the prompt's last tokens whose mean NLL is the score

    def record(self) -> dict:
        return dict(vars(self))


def family_name(kind: str, hay: str, placement: str) -> str:
    return f"{kind}/{hay}/{placement}"


class TokenCounter:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


def fill(hay: str, rng: random.Random, budget: int, count: TokenCounter) -> list[str]:
    gen = units(hay, rng)
    out, used = [], 0
    while used < budget:
        u = gen()
        out.append(u)
        used += count(u) + 1
    return out


def _value(kind: str, rng: random.Random) -> str:
    if kind in ("number", "multi"):
        return str(rng.randint(100000, 999999))
    if kind == "word":
        return rng.choice(ANSWER_WORDS)
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "identifier":
        return f"{rng.choice(('on', 'handle', 'run', 'flush'))}_{rng.choice(W)}_{rng.choice(ANSWER_WORDS)}"
    raise ValueError(kind)


KEY = {
    "number": ("access code of the {a} vault", "Answer with the number only."),
    "word": ("password of the {a} account", "Answer with one word."),
    "uuid": ("session id of the {a} job", "Answer with the UUID only."),
    "identifier": ("handler of the {a} event", "Answer with the function name only."),
    "multi": ("backup code of the {a} server", ""),
}


def make_prompt(kind: str, hay: str, placement: str, index: int, tokenizer, tokens: int, seed: int = 0) -> Prompt:
    """Prompt ``index`` of the family; ``tokens``: the user message's length in tokens (about)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; known: {', '.join(PLACEMENTS)}")
    fam = family_name(kind, hay, placement)
    rng = random.Random(f"{fam}:{index}:{seed}")
    count = TokenCounter(tokenizer)
    what = WHAT[hay]
    for _attempt in range(20):
        body = fill(hay, rng, tokens, count)
        # spread over prompts; past the sink and, at >= 1K tokens, further than the window (512) from the end
        depth = 0.15 + 0.3 * ((index * 0.6180339887) % 1.0)
        at = int(depth * len(body))
        if hay == "code":  # a statement of its own: the next line that starts at column 0
            at = next((i for i in range(at, len(body)) if body[i][:1].strip()), at)
        answers: list[str] = []
        distractors: list[str] = []
        if kind == "continue":  # the haystack alone, as a completions prompt: its last LOSS_TOKENS are scored
            content = SEP[hay].join(body)
            return Prompt(fam, "robust", kind, hay, placement, index, content, [], [], 1, 1.0, loss_tokens=LOSS_TOKENS)
        if kind == "summarize":  # the retrieval prompts' form, a summary asked instead of a fact
            if placement != "after":
                raise ValueError(f"{fam}: a summary is asked after the context")
            q = SUMMARY_Q.format(what=what.removeprefix("piece of "))
            content = f"Below is a {what}.\n\n{SEP[hay].join(body)}\n\n{q}"
            return Prompt(fam, "robust", kind, hay, placement, index, content, [], [], SUMMARY_TOKENS, 1.0, q)
        taken = {w for u in body for w in re.findall(r"[a-z]+", u.lower())}
        a = rng.choice([w for w in W if w not in taken] or W)
        if kind in KEY:
            if kind == "multi" and hay in ("code", "config"):
                raise ValueError(f"{fam}: multi needs a haystack where one key can take several values")
            phrase, fmt = KEY[kind]
            if hay == "code" and kind != "number":
                fmt = "Answer with the string only."
            key = phrase.format(a=a)
            name = ask_name(hay, key, quoted=kind != "number")
            if kind == "multi":
                b = rng.choice([w for w in W if w not in (a, *taken)] or [w for w in W if w != a])
                other = phrase.format(a=b)
                values = [_value(kind, rng) for _ in range(MULTI_ANSWERS + MULTI_OTHER)]
                answers, distractors = values[:MULTI_ANSWERS], values[MULTI_ANSWERS:]
                facts = [(key, v) for v in answers] + [(other, v) for v in distractors]
                rng.shuffle(facts)
                lo, nf = int(0.1 * len(body)), len(facts)
                spots = sorted(rng.sample(range(lo, max(lo + nf + 1, at + nf + 1)), nf))
                for (k, v), s in zip(reversed(facts), reversed(spots)):
                    body.insert(s, fact(hay, k, v, rng))
                q = f"What are the {MULTI_ANSWERS} numbers given as the {key}? Answer with the numbers only."
            else:
                value = _value(kind, rng)
                answers = [value]
                body.insert(at, fact(hay, key, value, rng, quote=kind != "number"))
                q = f"What is {name}? {fmt}"
        elif kind == "kv":
            keys = rng.sample([f"{x}_{y}" for x in W for y in ("limit", "quota", "burst", "window")], KV_PAIRS)
            vals = rng.sample(range(1000, 10000), KV_PAIRS)
            pairs = [(k, str(v)) for k, v in zip(keys, vals)]
            pick = rng.randrange(KV_PAIRS)
            answers, distractors = [pairs[pick][1]], [v for i, (_, v) in enumerate(pairs) if i != pick]
            body[at:at] = kv_block(hay, pairs, rng)
            q = f"In the limits, what is the value of {keys[pick]}? Answer with the number only."
        elif kind == "table":
            hosts = rng.sample([w for w in W if w not in taken] or W, TABLE_ROWS)
            ports = rng.sample(range(2000, 10000), TABLE_ROWS)
            rows = [(h, str(p), rng.choice(NICKS)) for h, p in zip(hosts, ports)]
            pick = rng.randrange(TABLE_ROWS)
            answers, distractors = [rows[pick][1]], [r[1] for i, r in enumerate(rows) if i != pick]
            body[at:at] = table_block(hay, rows)
            q = f"In the table of services, what is the port of the {hosts[pick]} service? Answer with the number only."
        else:
            raise ValueError(f"unknown retrieval kind {kind!r}; known: {', '.join(KINDS)}")
        context = SEP[hay].join(body)
        if not all(context.count(v) == 1 for v in answers + distractors):
            continue  # a value also occurs in the haystack by chance: draw again
        intro = f"Below is a {what}."
        if placement == "after":
            content = f"{intro}\n\n{context}\n\n{q}"
        else:  # the question first, and again after the context
            content = f"{q}\n\n{intro}\n\n{context}\n\n{q}"
        return Prompt(
            fam, "sensitive", kind, hay, placement, index, content, answers, distractors, MAX_TOKENS[kind], depth, q
        )
    raise RuntimeError(f"{fam} #{index}: no haystack without the answer values in 20 draws")


def design_cells(include_robust: bool = True) -> list[tuple[str, str, str]]:
    return list(CELLS) + (list(ROBUST_CELLS) if include_robust else [])


def build_prompts(cells, per_cell: int, tokenizer, tokens: int, seed: int = 0, robust_per_cell: int | None = None):
    """``per_cell`` prompts of every sensitive family, ``robust_per_cell`` (default the same) of every robust one."""
    n = {True: per_cell, False: per_cell if robust_per_cell is None else robust_per_cell}
    return [
        make_prompt(k, h, p, i, tokenizer, tokens, seed) for k, h, p in cells for i in range(n[k not in ROBUST_KINDS])
    ]
