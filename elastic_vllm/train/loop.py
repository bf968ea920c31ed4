"""Router training on a frozen backbone: straight-through Gumbel routing + Lagrangian sparsity loss.

Why one file of ~600 lines: the training step, its distributed plumbing and the checkpointing share the
router / Lagrange multiplier / optimizer state that ``train`` threads through them.

Per sequence X of task category c (one forward each; the step averages over ``batch_size`` of them)::

    every head: O = r_fa * O_fa + r_sa * O_sa,   r = onehot(argmax r_soft) + r_soft - sg(r_soft),
                r_soft = softmax((z + g) / tau),  z = router(pooled prompt keys),  g ~ Gumbel(0, 1)
    Omega  = mean over (layer, KV head) of r_sa           (hard in the forward, soft gradient)
    d      = Omega - t_c
    loss   = CE(answer tokens) + lambda1_c * d (or |d|) + lambda2_c * d^2

minimised over the router, MAXIMISED over (lambda1_c, lambda2_c) (their gradients are negated).
Gumbel noise is a pure function of (seed, step, sample index in the step), so a run is the same
with any number of ranks and after a resume.

Distributed (torchrun): the frozen backbone is sharded with FSDP2 (``fully_shard`` per decoder
layer + root), the router is replicated and its gradients are all-reduced by hand.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elastic_vllm.hf import enable_elastic
from elastic_vllm.hf.state import TrainContext
from elastic_vllm.models import sha256_file
from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, load_router, save_router
from elastic_vllm.router.model import ElasticRouter, decide
from elastic_vllm.train.config import CATEGORIES, TrainConfig
from elastic_vllm.train.data import Example, load_examples, sample_order

LOG_FILE = "train_log.jsonl"
FINISH_RESERVE_S = 15.0  # router, summary and plots after the last step
CKPT_DIR = "checkpoints"
LATEST = "LATEST"


# --- schedules -------------------------------------------------------------------------------
def lr_factor(cfg: TrainConfig, step: int, total: int | None = None) -> float:
    """Linear warmup over the first ``warmup`` share of steps, then cosine to 0. ``step`` is 0-based."""
    total = cfg.steps if total is None else total
    warm = int(cfg.warmup * total)
    if step < warm:
        return (step + 1) / warm
    p = (step - warm) / max(1, total - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))


def tau_at(cfg: TrainConfig, step: int, total: int | None = None) -> float:
    total = cfg.steps if total is None else total
    p = step / max(1, total - 1)
    if cfg.tau_schedule == "constant":
        return cfg.tau_init
    if cfg.tau_schedule == "exp":  # paper: max(tau_min, tau_init * exp(-r p))
        return max(cfg.tau_final, cfg.tau_init * math.exp(-cfg.tau_exp_rate * p))
    q = min(1.0, p / cfg.tau_anneal)  # authors' code: cosine tau_init -> tau_final over the first 60%
    return cfg.tau_final + (cfg.tau_init - cfg.tau_final) * 0.5 * (1.0 + math.cos(math.pi * q))


def gumbel_noise(seed: int, step: int, index: int, layers: int, heads: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [1, L, H, 2] for sample ``index`` of ``step`` (CPU generator: device independent)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + index)
    u = torch.rand(1, layers, heads, 2, generator=g).clamp_(1e-9, 1 - 1e-9)
    return -torch.log(-torch.log(u))


class Lambdas(torch.nn.Module):
    """Lagrange multipliers, one pair per task category."""

    def __init__(self, init: float = 0.0):
        super().__init__()
        self.lambda1 = torch.nn.Parameter(torch.full((len(CATEGORIES),), float(init)))
        self.lambda2 = torch.nn.Parameter(torch.full((len(CATEGORIES),), float(init)))

    def as_dict(self) -> dict[str, dict[str, float]]:
        l1, l2 = self.lambda1.detach().tolist(), self.lambda2.detach().tolist()
        return {c: {"lambda1": l1[i], "lambda2": l2[i]} for i, c in enumerate(CATEGORIES)}


# --- distributed -----------------------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist


def init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world, device). Under torchrun: NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "auto":
        dev = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(cfg.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{local}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1:
        dist = _dist()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return rank, world, dev


def _all_reduce_(tensors: list[torch.Tensor], world: int) -> None:
    if world == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    _dist().all_reduce(flat)
    at = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[at : at + n].view_as(t))
        at += n


def _agree(value: int, world: int, dev: torch.device) -> int:
    """Rank 0's value on every rank (time-based decisions must not differ between ranks)."""
    if world == 1:
        return int(value)
    t = torch.tensor([int(value)], device=dev)
    _dist().broadcast(t, 0)
    return int(t.item())


def _shard_backbone(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    for m in model.modules():
        if type(m).__name__ in names:
            fully_shard(m)
    fully_shard(model)


# --- model -----------------------------------------------------------------------------------
def resolve_dtype(cfg: TrainConfig, dev: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def load_backbone(cfg: TrainConfig, dev: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elastic_vllm.hf import register

    register()
    tok = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=resolve_dtype(cfg, dev), attn_implementation="elastic"
    )
    model.to(dev)
    model.requires_grad_(False)
    return model, tok


def backbone_meta(model, cfg: TrainConfig) -> BackboneMeta:
    from elastic_vllm.router.checkpoint import BackboneShape

    shape = BackboneShape.from_hf_config(model.config)
    bid = cfg.backbone_id or str(getattr(model.config, "_name_or_path", "") or Path(cfg.model).name)
    return BackboneMeta(**shape.model_dump(), id=bid, model_type=str(model.config.model_type))


# --- one forward: a right-padded batch of sequences ---------------------------------------------
def batch_loss(model, state, exs: list[Example], noise: torch.Tensor | None, tau: float, dev: torch.device) -> dict:
    """Forward ``exs`` as ONE right-padded batch; per row: CE over its answer tokens, straight-through Omega.

    No padding mask is passed: every attention the trainer runs (FA causal, SSA sink + window, both
    causal) only reads keys at or before the query, so a row's real tokens never see its trailing
    padding and positions stay 0..T_b-1: each row computes exactly what it would alone, and the
    fast unpadded paths (flash causal SDPA, banded SSA) run on the whole batch. One batch forward
    instead of one per sequence divides the kernel launches (what bounds a 135M model) by B.
    noise: [B, L, H_kv, 2] or None. Returns ce, omega, omega_argmax, each [B].
    """
    B = len(exs)
    T = max(ex.num_tokens for ex in exs)
    ids = torch.tensor([list(ex.input_ids) + [0] * (T - ex.num_tokens) for ex in exs], device=dev)
    state.train = TrainContext(
        prompt_lens=torch.tensor([ex.prompt_len for ex in exs], device=dev), gumbel=noise, tau=tau
    )
    # answer tokens: row b predicts ids[b, P:T_b] from the hidden states at P-1..T_b-2
    rows, pos, tgt, cnt = [], [], [], []
    for b, ex in enumerate(exs):
        n = ex.num_tokens - ex.prompt_len
        rows += [b] * n
        pos += range(ex.prompt_len - 1, ex.num_tokens - 1)
        tgt += ex.input_ids[ex.prompt_len :]
        cnt.append(n)
    rows_t, pos_t = torch.tensor(rows, device=dev), torch.tensor(pos, device=dev)
    # the LM head sees only the answer positions [1, N, D] (a [B, T, V] logits tensor would not fit):
    # a pre-hook inside the model's own forward, so FSDP's root hooks still gather the head's weights
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, args: (args[0][rows_t, pos_t][None], *args[1:]))
    try:
        out = model(input_ids=ids, use_cache=False, logits_to_keep=0)
    finally:
        hook.remove()
    tok_ce = F.cross_entropy(out.logits[0].float(), torch.tensor(tgt, device=dev), reduction="none")
    ce = torch.zeros(B, device=dev).index_add_(0, rows_t, tok_ce) / torch.tensor(cnt, device=dev, dtype=torch.float32)
    r = state.train.r_stack()  # [B, L, H, 2]
    logits = torch.stack([state.train.logits[i] for i in sorted(state.train.logits)], 1)
    return {"ce": ce, "omega": r[..., 0].mean((1, 2)), "omega_argmax": (~decide(logits.detach())).float().mean((1, 2))}


def sequence_loss(model, state, ex: Example, noise: torch.Tensor | None, tau: float, dev: torch.device) -> dict:
    """One sequence (``batch_loss`` with B = 1); scalars."""
    res = batch_loss(model, state, [ex], noise, tau, dev)
    return {k: v[0] for k, v in res.items()}


def microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group positions 0..n-1 into forwards of at most ``budget`` padded tokens (rows x longest row).

    Sorted by length first (little padding); a sequence longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


# --- router input standardization --------------------------------------------------------------
@torch.no_grad()
def calibrate_input_norm(model, state, router, examples: list[Example], n: int, rank: int, world: int, dev):
    """Per-(layer, KV head, dim) mean and 1/std of the router's pooled input over ``n`` prompts
    (split over the ranks, all-reduced): fixed before training, saved with the router."""
    L = router.num_layers
    mine = examples[rank::world][: max(1, n // world)]
    acc: dict[int, torch.Tensor] = {}
    real = state.router

    def recorder(layer: int, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.detach().double()[0]  # [H, d]
        acc[layer] = acc.get(layer, 0) + torch.stack([x, x * x])
        return real(layer, pooled)

    state.router, state.train = recorder, None
    try:
        for ex in mine:
            model(input_ids=torch.tensor([ex.input_ids[: ex.prompt_len]], device=dev), use_cache=False)
    finally:
        state.router = real
    if sorted(acc) != list(range(L)):
        raise RuntimeError(f"router input calibration saw layers {sorted(acc)}, expected 0..{L - 1}")
    sums = torch.stack([acc[i] for i in range(L)], 1)  # [2, L, H, d]
    count = torch.tensor([float(len(mine))], dtype=torch.float64, device=sums.device)
    _all_reduce_([sums, count], world)
    mean = sums[0] / count
    std = (sums[1] / count - mean * mean).clamp_min(0).sqrt()
    floor = 0.1 * std.mean(-1, keepdim=True).clamp_min(1e-6)  # a near-constant dim must not blow up
    return mean.float(), (1.0 / torch.maximum(std, floor)).float()


# --- checkpoints -----------------------------------------------------------------------------
def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(out: Path, step: int, router, lambdas, opt, sched, meta: RouterMeta, keep: int) -> Path:
    """Write checkpoints/step_NNNNNN/{router/, train_state.pt} via a temp folder + rename, then LATEST."""
    root = out / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_router(router, tmp / "router", meta)
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "lambdas": lambdas.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    torch.save(state, tmp / "train_state.pt")
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / LATEST, name + "\n")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(out: Path, router, lambdas, opt, sched) -> int:
    """Restore from checkpoints/LATEST; returns the number of finished steps (0 if none)."""
    root = out / CKPT_DIR
    if not (root / LATEST).is_file():
        return 0
    folder = root / (root / LATEST).read_text().strip()
    ck = load_router(folder / "router")
    router.load_state_dict(ck.router.state_dict())
    state = torch.load(folder / "train_state.pt", weights_only=True, map_location="cpu")
    lambdas.load_state_dict(state["lambdas"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    py = state["rng"]["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    return int(state["step"])


# --- the loop --------------------------------------------------------------------------------
def _optimizer(cfg: TrainConfig, router, lambdas: Lambdas) -> torch.optim.AdamW:
    """AdamW over the router (weight decay) and the Lagrange multipliers (none)."""
    return torch.optim.AdamW(
        [
            {"params": list(router.parameters()), "lr": cfg.router_lr, "weight_decay": cfg.weight_decay},
            {"params": list(lambdas.parameters()), "lr": cfg.lambda_lr, "weight_decay": 0.0},
        ],
        betas=cfg.betas,
    )


def _reduce_grads(params: list, lambdas: Lambdas, world: int, grad_clip: float) -> torch.Tensor:
    """Sum the ranks' gradients, negate the multipliers' (gradient ASCENT on them), clip the router's; returns
    the router's gradient norm before clipping."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    lam_grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in lambdas.parameters()]
    _all_reduce_(grads + lam_grads, world)
    for p, g in zip(params, grads):
        p.grad = g
    for p, g in zip(lambdas.parameters(), lam_grads):
        p.grad = -g
    return torch.nn.utils.clip_grad_norm_(params, grad_clip)


def _step_record(step: int, stats, cat_stats, tasks: list[str], cat_index: dict, batch_size: int) -> dict[str, Any]:
    """The log line of one step from the all-reduced sums: [ce, reg, tokens] + per task [n, omega, omega_argmax]
    (``stats``), per category [n, |Omega - target|] (``cat_stats``)."""
    rec: dict[str, Any] = {
        "step": step + 1,
        "lm_loss": float(stats[0]) / batch_size,
        "reg_loss": float(stats[1]) / batch_size,
        "tokens": int(stats[2]),
        "omega": {},
        "omega_argmax": {},
        "gap": {},
    }
    for ti, t in enumerate(tasks):
        n = float(stats[3 + 3 * ti])
        if n:
            rec["omega"][t] = float(stats[4 + 3 * ti]) / n
            rec["omega_argmax"][t] = float(stats[5 + 3 * ti]) / n
    for c, i in cat_index.items():
        if cat_stats[i, 0]:
            rec["gap"][c] = float(cat_stats[i, 1] / cat_stats[i, 0])
    return rec


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train the router; returns the summary (also written to ``out/summary.json`` by rank 0)."""
    rank, world, dev = init_distributed(cfg)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of the number of ranks {world}")
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    t_start = time.time()

    model, tok = load_backbone(cfg, dev)
    examples, skipped = load_examples(cfg.data, tok, cfg.max_tokens)
    meta_b = backbone_meta(model, cfg)
    torch.manual_seed(cfg.seed)
    router = ElasticRouter(meta_b.num_layers, meta_b.head_dim).to(dev)
    state = enable_elastic(model, cfg.elastic, router, impl=cfg.impl)
    if cfg.input_norm_samples:
        shift, scale = calibrate_input_norm(model, state, router, examples, cfg.input_norm_samples, rank, world, dev)
        router.set_input_norm(shift, scale)
    router.requires_grad_(True).train()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing is active in train mode only; these backbones have no dropout
    if world > 1 and cfg.fsdp:
        _shard_backbone(model)

    lambdas = Lambdas(cfg.lambda_init).to(dev)
    opt = _optimizer(cfg, router, lambdas)
    total = cfg.steps  # may shrink once, early, to fit time_budget_s (the schedules follow it)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s, total))
    meta = RouterMeta(
        backbone=meta_b,
        pooling={"mode": cfg.elastic.pooling, "tokens": cfg.elastic.pool_tokens},
        attention=cfg.elastic.model_dump(mode="json"),
    )
    start = load_checkpoint(out, router, lambdas, opt, sched) if cfg.resume else 0
    log_path = out / LOG_FILE
    if rank == 0:
        kept = []
        if start and log_path.is_file():
            kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
        log_path.write_text("".join(ln + "\n" for ln in kept))
    targets = torch.tensor([cfg.targets[c] for c in CATEGORIES], device=dev)
    cat_index = {c: i for i, c in enumerate(CATEGORIES)}
    tasks = sorted({ex.task for ex in examples})
    stream = sample_order(examples, cfg.seed)
    for _ in range(start * cfg.batch_size):
        next(stream)

    L, H = meta_b.num_layers, meta_b.num_kv_heads
    per_rank = cfg.batch_size // world
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        # not a terminal (a log file, a remote job): a line every 10 s instead of a redraw per step
        bar = tqdm(
            total=cfg.steps,
            initial=start,
            desc="train-router",
            dynamic_ncols=True,
            mininterval=0.2 if sys.stderr.isatty() else 10.0,
        )
    params = list(router.parameters())
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    stopped_early, step = None, start
    t_loop = t_cal = time.time()
    while step < end:
        t0 = time.time()
        if cfg.time_budget_s is not None and step > start:
            if step == start + 2:
                t_cal = t0  # the first two steps pay for CUDA/kernel warm-up: not timed
            if step == start + 6:  # fit the planned steps (and with them the schedules) to the budget
                per_step = (t0 - t_cal) / 4
                left = cfg.time_budget_s - (t0 - t_start) - FINISH_RESERVE_S
                fit = _agree(min(total, step + max(1, int(left / per_step))), world, dev)
                if fit < total:
                    if rank == 0:
                        print(
                            f"train-router: {per_step:.2f} s/step; {total} steps would pass the time budget "
                            f"of {cfg.time_budget_s:.0f} s: training {fit} steps (schedules follow)",
                            file=sys.stderr,
                        )
                    total = fit
                    end = min(end, total)
                    if bar is not None:
                        bar.total = total
                        bar.refresh()
            timed = step - start - 2
            per_step = (t0 - t_cal) / timed if timed > 0 else (t0 - t_loop) / (step - start)
            if _agree(int(t0 - t_start + per_step > cfg.time_budget_s), world, dev):
                stopped_early = step
                break
        tau = tau_at(cfg, step, total)
        batch = [next(stream) for _ in range(cfg.batch_size)]
        mine = list(range(rank * per_rank, (rank + 1) * per_rank))
        # per-rank sums, all-reduced for the log: [ce, reg, tokens] + per task [n, omega, omega_argmax]
        stats = torch.zeros(3 + 3 * len(tasks), dtype=torch.float64)
        cat_stats = torch.zeros(len(CATEGORIES), 2, dtype=torch.float64)  # [n, |d|]
        exs = [examples[batch[j]] for j in mine]
        for group in microbatches([ex.num_tokens for ex in exs], cfg.microbatch_tokens):
            js = [mine[g] for g in group]
            mb = [exs[g] for g in group]
            noise = torch.cat([gumbel_noise(cfg.seed, step, j, L, H) for j in js]).to(dev) if cfg.gumbel else None
            res = batch_loss(model, state, mb, noise, tau, dev)
            c = torch.tensor([cat_index[ex.category] for ex in mb], device=dev)
            d = res["omega"] - targets[c]
            lin = d if cfg.linear_term == "signed" else d.abs()
            reg = lambdas.lambda1[c] * lin + lambdas.lambda2[c] * d * d
            ((res["ce"] + reg).sum() / cfg.batch_size).backward()
            state.train = None
            # one host sync per forward for everything the log needs
            vals = torch.stack([res["ce"], reg, res["omega"], res["omega_argmax"], d]).tolist()
            for k, ex in enumerate(mb):
                ce_v, reg_v, om_v, oma_v, d_v = (v[k] for v in vals)
                ti, ci = tasks.index(ex.task), cat_index[ex.category]
                stats[0] += ce_v
                stats[1] += reg_v
                stats[2] += ex.num_tokens
                stats[3 + 3 * ti : 6 + 3 * ti] += torch.tensor([1.0, om_v, oma_v], dtype=torch.float64)
                cat_stats[ci] += torch.tensor([1.0, abs(d_v)], dtype=torch.float64)
        gnorm = _reduce_grads(params, lambdas, world, cfg.grad_clip)
        lrs = [g["lr"] for g in opt.param_groups]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        both = torch.cat([stats, cat_stats.flatten()]).to(dev)
        _all_reduce_([both], world)
        both = both.cpu()
        stats, cat_stats = both[: stats.numel()], both[stats.numel() :].view(len(CATEGORIES), 2)
        rec = _step_record(step, stats, cat_stats, tasks, cat_index, cfg.batch_size)
        rec.update(tau=tau, lr_router=lrs[0], lr_lambda=lrs[1], grad_norm=float(gnorm), step_s=time.time() - t0,
                   lambdas=lambdas.as_dict())  # fmt: skip
        if rank == 0:
            if (step + 1) % cfg.log_every == 0 or step + 1 == total:
                with open(log_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(lm=f"{rec['lm_loss']:.3f}", reg=f"{rec['reg_loss']:.4f}", tau=f"{tau:.2f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            if rank == 0:
                save_checkpoint(out, step + 1, router, lambdas, opt, sched, meta, cfg.keep_checkpoints)
            if world > 1:
                _dist().barrier()
        step += 1
    if bar is not None:
        bar.close()
    if stopped_early is not None:
        if rank == 0:
            print(
                f"train-router: time budget {cfg.time_budget_s} s reached, stopping after step {stopped_early}",
                file=sys.stderr,
            )
            save_checkpoint(out, stopped_early, router, lambdas, opt, sched, meta, cfg.keep_checkpoints)
        end = total  # finish: the router of the last step is the result

    summary: dict[str, Any] = {}
    if end == total and cfg.rank_prompts:  # every rank: a sharded backbone's forwards are collective
        meta = meta.model_copy(update={"retrieval": _ranking(cfg, model, tok, state, dev, rank)})
    if rank == 0 and end == total:
        summary = _finish(cfg, out, router, lambdas, meta, examples, skipped, time.time() - t_start, dev)
        extra = {}
        if total != cfg.steps:
            extra["steps_fitted_to_time_budget"] = total
        if stopped_early is not None:
            extra["stopped_early_at_step"] = stopped_early
        if extra:
            summary.update(extra)
            _write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    if world > 1:
        _dist().barrier()
    state.train = None
    return summary


def summarize_log(records: list[dict], tail: float = 0.2) -> dict[str, Any]:
    """Per task and category: mean realized Omega_MSR (argmax, noise-free) over the last ``tail`` of steps."""
    if not records:
        return {}
    n = max(1, int(len(records) * tail))
    last = records[-n:]
    per_task: dict[str, list[float]] = {}
    for r in last:
        for t, v in r["omega_argmax"].items():
            per_task.setdefault(t, []).append(v)
    return {
        "omega_msr_by_task": {t: sum(v) / len(v) for t, v in sorted(per_task.items())},
        "lm_loss": sum(r["lm_loss"] for r in last) / len(last),
        "steps_averaged": len(last),
    }


def _ranking(cfg: TrainConfig, model, tok, state, dev, rank: int):
    """The retrieval-head ranking of the backbone (``train/ranking.py``) for the router's checkpoint."""
    from elastic_vllm.train.ranking import calibration_records, measure_ranking

    records, desc = calibration_records(tok, cfg.rank_lengths, cfg.rank_prompts, haystack=cfg.rank_haystack)
    desc = {**desc, "model": Path(cfg.model).name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    state.train = None
    t0 = time.perf_counter()
    ranking = measure_ranking(model, tok, records, desc, dev)
    if rank == 0:
        print(f"train-router: retrieval-head ranking from {len(records)} prompts ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)  # fmt: skip
    return ranking


def _finish(cfg, out, router, lambdas, meta, examples, skipped, wall, dev) -> dict[str, Any]:
    import transformers

    records = [json.loads(ln) for ln in (out / LOG_FILE).read_text().splitlines() if ln]
    tail = summarize_log(records)
    cats: dict[str, list[float]] = {}
    task_cat = {ex.task: ex.category for ex in examples}
    for t, v in tail.get("omega_msr_by_task", {}).items():
        cats.setdefault(task_cat[t], []).append(v)
    by_cat = {c: sum(v) / len(v) for c, v in cats.items()}
    summary = {
        "steps": len(records) and records[-1]["step"],
        "steps_planned": cfg.steps,
        "batch_size": cfg.batch_size,
        "examples": len(examples),
        "skipped_too_long": skipped,
        "tasks": {t: sum(1 for e in examples if e.task == t) for t in sorted(task_cat)},
        "data": str(cfg.data),
        "data_sha256": sha256_file(Path(cfg.data)),
        "targets": cfg.targets,
        "linear_term": cfg.linear_term,
        "tau_schedule": cfg.tau_schedule,
        "seed": cfg.seed,
        "lambdas": lambdas.as_dict(),
        "final_window": tail,
        "omega_msr_by_category": by_cat,
        "wall_s": round(wall, 1),
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    meta = meta.model_copy(update={"training": summary})
    save_router(router, out / "router", meta)
    if cfg.plots:
        from elastic_vllm.train.plots import plot_log

        summary["plots"] = plot_log(records, out / "plots")
    _write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
