"""``elastic-vllm train-router`` and ``elastic-vllm build-data`` (registered in ``elastic_vllm.cli``)."""

from __future__ import annotations

import argparse
import json

from elastic_vllm.train.config import TrainConfig


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
    return TrainConfig(
        model=a.model,
        data=a.data,
        out=a.out,
        elastic=elastic,
        steps=a.steps,
        batch_size=a.batch_size,
        max_tokens=a.max_tokens,
        microbatch_tokens=a.microbatch_tokens,
        input_norm_samples=a.input_norm_samples,
        router_lr=a.router_lr,
        lambda_lr=a.lambda_lr,
        weight_decay=a.weight_decay,
        warmup=a.warmup,
        grad_clip=a.grad_clip,
        tau_schedule=a.tau_schedule,
        tau_init=a.tau_init,
        tau_final=a.tau_final,
        linear_term=a.linear_term,
        targets={"robust": a.target_robust, "sensitive": a.target_sensitive},
        lambda_init=a.lambda_init,
        gumbel=not a.no_gumbel,
        seed=a.seed,
        impl=a.impl,
        dtype=a.dtype,
        device=a.device,
        gradient_checkpointing=not a.no_gradient_checkpointing,
        fsdp=not a.no_fsdp,
        save_every=a.save_every,
        resume=a.resume,
        stop_after=a.stop_after,
        time_budget_s=a.time_budget_s,
        plots=not a.no_plots,
        progress=not a.no_progress,
        backbone_id=a.backbone_id,
        rank_prompts=a.rank_prompts,
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


def build_data_args(p: argparse.ArgumentParser) -> None:
    from elastic_vllm.train.build import add_build_args

    add_build_args(p)


def build_data(a: argparse.Namespace) -> int:
    from elastic_vllm.train.build import build_from_args

    print(json.dumps(build_from_args(a)))
    return 0


def close_process_group() -> None:
    """The CLI process owns torchrun's process group (``init_distributed`` made it): destroy it before the
    interpreter exits. Left to teardown, gloo's threads can be destroyed while joinable and the rank aborts
    ("terminate called without an active exception", SIGABRT; seen once in the 2-process CPU test)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
