"""``elastic-vllm train-router`` and ``elastic-vllm build-data`` (registered in ``elastic_vllm.cli``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elastic_vllm.train.build import TASKS, build, build_generalization
from elastic_vllm.train.config import TrainConfig
from elastic_vllm.train.sources import fetch_sources


def train_router_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig.model_fields
    p.add_argument("--model", required=True, help="transformers model folder (the frozen backbone)")
    p.add_argument("--data", required=True, help="mixture JSONL(.gz) written by `elastic-vllm build-data`")
    p.add_argument("--out", required=True, help="output folder (router/, checkpoints/, train_log.jsonl, plots/)")
    p.add_argument("--elastic", default="{}", help='attention config JSON, e.g. \'{"window": 512, "sink": 128}\'')
    p.add_argument("--window", type=int, help="shortcut for elastic.window")
    p.add_argument("--sink", type=int, help="shortcut for elastic.sink")
    p.add_argument("--mode", choices=["FA-SSA", "FA-XA", "XA-SSA"], help="shortcut for elastic.mode")
    for name, flag, typ in (
        ("steps", "--steps", int),
        ("batch_size", "--batch-size", int),
        ("max_tokens", "--max-tokens", int),
        ("microbatch_tokens", "--microbatch-tokens", int),
        ("input_norm_samples", "--input-norm-samples", int),
        ("router_lr", "--router-lr", float),
        ("lambda_lr", "--lambda-lr", float),
        ("weight_decay", "--weight-decay", float),
        ("warmup", "--warmup", float),
        ("grad_clip", "--grad-clip", float),
        ("tau_init", "--tau-init", float),
        ("tau_final", "--tau-final", float),
        ("lambda_init", "--lambda-init", float),
        ("seed", "--seed", int),
        ("save_every", "--save-every", int),
    ):
        p.add_argument(flag, type=typ, default=d[name].default, help=f"(default {d[name].default})")
    p.add_argument("--tau-schedule", choices=["cosine", "exp", "constant"], default="cosine")
    p.add_argument("--linear-term", choices=["signed", "abs"], default="signed")
    p.add_argument("--target-robust", type=float, default=1.0)
    p.add_argument("--target-sensitive", type=float, default=0.7)
    p.add_argument(
        "--impl", choices=["torch", "reference"], default="torch", help="attention path (reference: slow oracle)"
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--no-fsdp", action="store_true", help="under torchrun: replicate the backbone instead of sharding")
    p.add_argument("--no-gumbel", action="store_true", help="straight-through without Gumbel noise")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/LATEST")
    p.add_argument("--stop-after", type=int, help="end this run after N more steps (checkpointed; --resume goes on)")
    p.add_argument(
        "--time-budget-s", type=float, help="stop early, still writing router/summary/plots, before passing this"
    )
    p.add_argument("--backbone-id", help="backbone name recorded in router.json")
    p.add_argument(
        "--rank-prompts", type=int, default=d["rank_prompts"].default,
        help="calibration needle prompts per length for the retrieval-head ranking stored in the router (0: none; "
        f"fa_floor needs it) (default {d['rank_prompts'].default})",
    )  # fmt: skip
    p.add_argument("--rank-lengths", type=int, nargs="+", default=list(d["rank_lengths"].default),
                   help="calibration prompt lengths in tokens")  # fmt: skip


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    elastic = json.loads(a.elastic)
    for k in ("window", "sink", "mode"):
        if getattr(a, k) is not None:
            elastic[k] = getattr(a, k)
    # the flags whose attribute is the TrainConfig field of the same name
    same = ("model", "data", "out", "steps", "batch_size", "max_tokens", "microbatch_tokens", "input_norm_samples",
            "router_lr", "lambda_lr", "weight_decay", "warmup", "grad_clip", "tau_schedule", "tau_init", "tau_final",
            "linear_term", "lambda_init", "seed", "impl", "dtype", "device", "save_every", "resume", "stop_after",
            "time_budget_s", "backbone_id", "rank_prompts")  # fmt: skip
    return TrainConfig(
        **{k: getattr(a, k) for k in same},
        elastic=elastic,
        targets={"robust": a.target_robust, "sensitive": a.target_sensitive},
        gumbel=not a.no_gumbel,
        gradient_checkpointing=not a.no_gradient_checkpointing,
        fsdp=not a.no_fsdp,
        plots=not a.no_plots,
        progress=not a.no_progress,
        rank_lengths=tuple(a.rank_lengths),
    )


def train_router(a: argparse.Namespace) -> int:
    from elastic_vllm.train.loop import train

    try:
        summary = train(config_from_args(a))
    finally:
        close_process_group()
    if summary:
        print(json.dumps({k: summary[k] for k in ("omega_msr_by_category", "final_window", "lambdas", "wall_s")}))
    return 0


def build_data(a: argparse.Namespace) -> int:
    print(json.dumps(build_from_args(a)))
    return 0


def build_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder (train.jsonl.gz, eval.jsonl.gz, manifest.json)")
    p.add_argument("--tokenizer", help="tokenizer folder that measures lengths (default: the demo model's)")
    p.add_argument("--sources", help="source folder (default: $ELASTIC_VLLM_CACHE/sources, fetched on first use)")
    p.add_argument("--no-fetch", action="store_true", help="use --sources as is; fail instead of downloading")
    p.add_argument("--skip-source", action="append", default=[], choices=["linuxdoc"], help="leave a source out")
    p.add_argument("--per-task", type=int, default=120, help="train samples per task (default 120)")
    p.add_argument("--eval-per-task", type=int, default=20, help="held-out samples per task (default 20)")
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument(
        "--tasks",
        help=f"comma-separated subset of {','.join(TASKS)} (default: all; --version 4: the first six, see DATA.md)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gzip", action="store_true")
    p.add_argument(
        "--task-counts",
        default="",
        help="train samples of some tasks instead of --per-task, e.g. retrieval=360,local=240 (eval scales alike)",
    )
    p.add_argument(
        "--version",
        type=int,
        choices=(3, 4),
        default=3,
        help="builder version: 3 (the tasks as counted) or 4 (balanced: every sample has a partner of the other "
        "category on the same haystack, source, form and template; DATA.md)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=240,
        help="--version 4: grid pairs (sensitive + robust) on top of the first tasks' partners (default 240)",
    )
    p.add_argument(
        "--generalization",
        type=int,
        default=0,
        metavar="N",
        help="instead of the mixture: the generalization split, N sensitive + N robust samples per held-out family",
    )


def parse_task_counts(spec: str) -> dict[str, int]:
    """ "retrieval=360,local=240" -> {"retrieval": 360, "local": 240}; errors name --task-counts."""
    out: dict[str, int] = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, _, val = part.partition("=")
        if name not in TASKS:
            raise ValueError(f"--task-counts: unknown task {name!r} (known: {', '.join(TASKS)})")
        if not val.isdigit():
            raise ValueError(f"--task-counts: {name} needs a count >= 0, got {val!r}")
        out[name] = int(val)
    return out


def build_from_args(a: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from elastic_vllm.models import cache_dir, fetch_demo_model
    from elastic_vllm.train.balanced import LEGACY_TASKS, check_tasks

    v4 = a.version == 4
    tasks = tuple(t for t in a.tasks.split(",") if t) if a.tasks else (LEGACY_TASKS if v4 else tuple(TASKS))
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"--tasks: unknown {sorted(unknown)} (known: {', '.join(TASKS)})")
    if v4 and (a.task_counts or a.generalization):
        raise ValueError(
            "--version 4 balances the counts itself (--per-task, --pairs): drop --task-counts; the generalization "
            "split does not depend on the version: build it without --version 4"
        )
    if v4 and a.pairs < 0:
        raise ValueError(f"--pairs must be >= 0, got {a.pairs}")
    if v4:
        check_tasks(tasks)
    src = Path(a.sources) if a.sources else cache_dir() / "sources"
    if not a.no_fetch:
        fetch_sources(src, skip=tuple(a.skip_source))
    tok = AutoTokenizer.from_pretrained(str(a.tokenizer or fetch_demo_model(quiet=True)))
    if a.generalization:
        m = build_generalization(
            a.out, tok, src, a.generalization, a.min_tokens, a.max_tokens, a.seed, gz=not a.no_gzip
        )
        return {
            "out": a.out,
            "files": m["files"],
            "generalization": {f: s["n"] for f, s in m["splits"]["generalization"].items()},
        }
    if v4:
        from elastic_vllm.train.balanced import build_balanced

        m = build_balanced(
            a.out, tok, src, a.per_task, a.eval_per_task, a.pairs, a.min_tokens, a.max_tokens, a.seed, tasks,
            gz=not a.no_gzip,
        )  # fmt: skip
        bal = m["balance"]["train"]
        return {
            "out": a.out,
            "files": m["files"],
            "train": bal["by_haystack"],
            "predictor_accuracy": bal["predictor_accuracy"],
        }
    counts = parse_task_counts(a.task_counts)
    m = build(
        a.out, tok, src, a.per_task, a.eval_per_task, a.min_tokens, a.max_tokens, a.seed, tasks, gz=not a.no_gzip,
        task_counts=counts,
    )  # fmt: skip
    return {"out": a.out, "files": m["files"], "train": {t: s["n"] for t, s in m["splits"].get("train", {}).items()}}


def close_process_group() -> None:
    """The CLI process owns torchrun's process group (``init_distributed`` made it): destroy it before the
    interpreter exits. Left to teardown, gloo's threads can be destroyed while joinable and the rank aborts
    ("terminate called without an active exception", SIGABRT; seen once in the 2-process CPU test)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
