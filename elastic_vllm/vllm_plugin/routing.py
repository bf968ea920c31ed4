"""Routing inside the vLLM backend: boundary keys from the paged cache -> pre-RoPE -> router.

The paged cache holds POST-RoPE keys (post k_norm for Qwen3); the router wants PRE-RoPE keys. The
boundary keys of a request (first/last ``pool_tokens`` of the routed prefix, ``boundary_positions``)
are gathered from the cache and rotated back with the model's own RoPE (``reference.rope``)::

    key_cache [num_blocks, block_size, Hkv, D] --gather(block_table, positions)--> [N, Hkv, D]
      --invert_rope--> pre-RoPE [N, Hkv, D] --segment mean per row--> pooled [R, Hkv, D]
      --router layer l--> logits [R, Hkv, 2] --decide(sa_margin), force--> FA? [R, Hkv] --> HeadMode [R, Hkv]

Everything here is plain torch on the cache's device, built once per step (:func:`build_route_batch`)
and reused by every layer (:func:`route_layer`): a few small kernels per layer, none per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.reference.rope import RopeSpec, invert_rope
from elastic_vllm.router.model import ElasticRouter, boundary_positions, decide, decide_budget, effective_margin

FORCE_CODE = {"auto": 0, "all-FA": 1, "all-SA": 2}


@dataclass(frozen=True)
class RouteRow:
    """One batch row routed at this step (host description)."""

    row: int  # row index in the batch (query_start_loc order)
    end: int  # the router pools over tokens [0, end): the prompt (final) or the prefix so far (chunk)
    force: str  # "auto" | "all-FA" | "all-SA"
    decode_phase: bool  # the row's queries lie past the prompt: decode_mode applies to its attention
    final_slot: int | None  # routing-table slot when this routing is the request's final one
    bias: float = 0.0  # routing bias (its own, the server's + the load policy's): FA iff z_FA - z_SA > bias - sa_margin
    target: float | None = None  # fixed SA budget (elastic_target_omega / target_omega): budget_sa_counts


@dataclass
class RouteBatch:
    """Device tensors of this step's routing rows (R rows, N pooled tokens)."""

    rows: torch.Tensor  # [R] long: batch rows
    ends: torch.Tensor  # [R] int32: routed prefix length of each row
    block_table: torch.Tensor  # [B, max_blocks] int32 of this step
    force: torch.Tensor  # [R] int8: FORCE_CODE
    decode_phase: torch.Tensor  # [R] bool
    token_row: torch.Tensor  # [N] long: routing row of each pooled token
    token_pos: torch.Tensor  # [N] long: position of each pooled token
    token_slot: torch.Tensor  # [N] long: flat cache slot (block * block_size + offset)
    inv_count: torch.Tensor  # [R, 1, 1] float32: 1 / pooled tokens of each row
    final_idx: torch.Tensor  # [F] long: routing rows whose routing is final
    final_slots: torch.Tensor  # [F] long: their routing-table slots
    any_auto: bool  # some row needs the router (not every row forced)
    # host facts of the rows, so the per-layer glue launches no op that would change nothing (H200 e2e:
    # the router-step time of an 8K prefill was 12-14 ms before, 1.5-2.2 ms with these and the faster kernel)
    any_forced: bool  # some row is all-FA / all-SA
    any_decode_phase: bool  # some row's queries are past its prompt
    rows_i32: torch.Tensor  # [R] int32: rows, for the router kernel (cast once per step)
    final_slot_row: torch.Tensor  # [R] int32: each row's routing-table slot if its routing is final, else -1
    host: list[RouteRow]
    # the bias every row shares (the fused router kernel takes one margin scalar), or None when rows differ
    uniform_bias: float | None = 0.0
    biases: torch.Tensor | None = None  # [R, 1] float64 biases when they differ (the margin is rounded to float32 once)
    budget_idx: torch.Tensor | None = None  # [T] long: routing rows with a fixed SA budget (target)
    budget_sa: torch.Tensor | None = None  # [T, L] long: their SA heads per layer (this rank's heads)
    neg_margins: torch.Tensor | None = None  # [R] float32 bias - sa_margin when biases differ (the fused kernel's)

    @property
    def needs_glue(self) -> bool:
        """Some row's decisions are not the fused kernel's thresholded argmax: budgets (a budget ranks the heads
        of a row, which one (row, head) program cannot) run through :func:`route_layer`."""
        return self.budget_idx is not None


def build_route_batch(
    rows: list[RouteRow],
    block_table: torch.Tensor,
    block_size: int,
    pooling: str,
    pool_tokens: int,
    budget_sa: Callable[[float], list[int]] | None = None,
) -> RouteBatch:
    """Gather indices of every routing row's pooled tokens, built on the block table's device.
    ``budget_sa(target)`` gives the SA heads per layer of rows with a ``target`` (this rank's heads,
    ``budget_sa_counts``)."""
    dev = block_table.device
    pos_list, row_list = [], []
    for i, r in enumerate(rows):
        if pooling == "whole":
            p = torch.arange(r.end)
        else:
            p = boundary_positions(r.end, pool_tokens)
        pos_list.append(p)
        row_list.append(torch.full((p.numel(),), i, dtype=torch.long))
    pos = torch.cat(pos_list).to(dev, non_blocking=True)
    token_row = torch.cat(row_list).to(dev, non_blocking=True)
    counts = torch.tensor([float(p.numel()) for p in pos_list], dtype=torch.float32)
    batch_rows = torch.tensor([r.row for r in rows], dtype=torch.long).to(dev, non_blocking=True)
    blocks = block_table.index_select(0, batch_rows)[token_row, pos // block_size].long()  # [N]
    final = [(i, r.final_slot) for i, r in enumerate(rows) if r.final_slot is not None]
    budgeted = [(i, r.target) for i, r in enumerate(rows) if r.target is not None]
    budget_idx = budget = None
    if budgeted:
        if budget_sa is None:
            raise RuntimeError("elastic: a routing row has a target but no budget_sa function was given")
        budget_idx = torch.tensor([i for i, _ in budgeted], dtype=torch.long).to(dev, non_blocking=True)
        budget = torch.tensor([budget_sa(v) for _, v in budgeted], dtype=torch.long).to(dev, non_blocking=True)
    bias_set = {r.bias for r in rows}
    uniform = next(iter(bias_set)) if len(bias_set) == 1 else None
    biases = None
    if uniform is None:
        biases = torch.tensor([[r.bias] for r in rows], dtype=torch.float64).to(dev, non_blocking=True)
    return RouteBatch(
        rows=batch_rows,
        ends=torch.tensor([r.end for r in rows], dtype=torch.int32).to(dev, non_blocking=True),
        block_table=block_table,
        force=torch.tensor([FORCE_CODE[r.force] for r in rows], dtype=torch.int8).to(dev, non_blocking=True),
        decode_phase=torch.tensor([r.decode_phase for r in rows], dtype=torch.bool).to(dev, non_blocking=True),
        token_row=token_row,
        token_pos=pos,
        token_slot=blocks * block_size + pos % block_size,
        inv_count=(1.0 / counts).view(-1, 1, 1).to(dev, non_blocking=True),
        final_idx=torch.tensor([i for i, _ in final], dtype=torch.long).to(dev, non_blocking=True),
        final_slots=torch.tensor([s for _, s in final], dtype=torch.long).to(dev, non_blocking=True),
        any_auto=any(r.force == "auto" for r in rows),
        any_forced=any(r.force != "auto" for r in rows),
        any_decode_phase=any(r.decode_phase for r in rows),
        rows_i32=batch_rows.to(torch.int32),
        final_slot_row=torch.tensor([-1 if r.final_slot is None else r.final_slot for r in rows], dtype=torch.int32).to(
            dev, non_blocking=True
        ),
        host=rows,
        uniform_bias=uniform,
        biases=biases,
        budget_idx=budget_idx,
        budget_sa=budget,
    )


def pooled_prerope_keys(key_cache: torch.Tensor, rb: RouteBatch, rope: RopeSpec) -> torch.Tensor:
    """Pooled pre-RoPE keys [R, Hkv, D] (float32) of the routing rows, read from the paged cache."""
    k = key_cache.flatten(0, 1).index_select(0, rb.token_slot)  # [N, Hkv, D], post-RoPE
    k = invert_rope(k, rb.token_pos, rope)  # float32
    R = rb.rows.numel()
    pooled = torch.zeros(R, k.shape[1], k.shape[2], dtype=torch.float32, device=k.device)
    pooled.index_add_(0, rb.token_row, k)
    return pooled * rb.inv_count


_MODE_SCALARS: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def decisions_to_modes(fa: torch.Tensor, cfg: ElasticConfig) -> torch.Tensor:
    """bool FA? -> HeadMode (int8): FA -> cfg.fa_mode, SA -> cfg.sa_mode. The two mode scalars are
    device tensors made once per device (not two host-to-device copies per layer)."""
    key = (fa.device, int(cfg.fa_mode), int(cfg.sa_mode))
    pair = _MODE_SCALARS.get(key)
    if pair is None:
        pair = _MODE_SCALARS[key] = tuple(torch.tensor(v, dtype=torch.int8, device=fa.device) for v in key[1:])
    return torch.where(fa, pair[0], pair[1])


def decode_modes(modes: torch.Tensor, decode_mode: str) -> torch.Tensor:
    """Head modes of decode-phase queries: ``dense`` -> every head FA (the paper); ``sparse`` -> SSA
    heads keep their sink + window, XA (block-sparse prefill) heads attend densely."""
    if decode_mode == "dense":
        return torch.zeros_like(modes)
    return torch.where(modes == HeadMode.SSA, modes, torch.zeros_like(modes))


def route_layer(
    layer: int,
    key_cache: torch.Tensor,
    rb: RouteBatch,
    router: ElasticRouter | None,
    rope: RopeSpec,
    cfg: ElasticConfig,
    num_kv_heads: int,
    kernel: TritonRouter | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Route the rows of ``rb`` at ``layer`` (with ``kernel``: the fused Triton router).

    Returns (logits [R, Hkv, 2] float32 (zeros where no router ran), FA? [R, Hkv] bool,
    prefill head modes [R, Hkv] int8, pooled [R, Hkv, D] or None (forced rows, Triton router)).
    """
    R = rb.rows.numel()
    dev = key_cache.device
    pooled = None
    if rb.any_auto:
        if router is None:
            raise RuntimeError("elastic: a request needs the router but none is loaded")
        if kernel is not None:
            logits = kernel.logits(layer, key_cache, rb, cfg)
        else:
            pooled = pooled_prerope_keys(key_cache, rb, rope)
            with torch.no_grad():
                logits = router(layer, pooled)
        if rb.biases is None:
            fa = decide(logits, effective_margin(cfg.sa_margin, rb.uniform_bias))
        else:  # per-row margins sa_margin - bias, each rounded to float32 once as the kernel's scalar is
            fa = decide(logits, (cfg.sa_margin - rb.biases).float())
        if rb.budget_idx is not None:  # fixed SA budgets (targets): the lowest margins of the layer go SA
            b = rb.budget_idx
            fa = fa.index_copy(0, b, decide_budget(logits.index_select(0, b), rb.budget_sa[:, layer]))
    else:
        logits = torch.zeros(R, num_kv_heads, 2, dtype=torch.float32, device=dev)
        fa = torch.zeros(R, num_kv_heads, dtype=torch.bool, device=dev)
    if rb.any_forced:
        force = rb.force.view(-1, 1)
        fa = torch.where(force == FORCE_CODE["all-FA"], True, torch.where(force == FORCE_CODE["all-SA"], False, fa))
    return logits, fa, decisions_to_modes(fa, cfg), pooled


class TritonRouter:
    """The fused router kernel (``elastic_vllm.csrc.route``): gather, RoPE inversion, pooling and both
    MLPs of all routing rows of one layer in one launch; its logits feed the same decision code."""

    def __init__(
        self, router: ElasticRouter, rope: RopeSpec, num_layers: int, num_kv_heads: int, max_rows: int, device
    ):
        from elastic_vllm.csrc.route import pack_router_norm, pack_router_weights

        self.weights = pack_router_weights(router).to(device).contiguous()
        norm = pack_router_norm(router)  # the router's input standardization, if it has one
        self.norm = None if norm is None else norm.to(device).contiguous()
        self.inv_freq = rope.inv_freq.to(device, torch.float32)
        self.scaling = float(rope.attention_scaling)
        # the kernel also writes decisions into a table; ours come from its logits, so a scratch one
        self.scratch = torch.zeros(max_rows, num_layers, num_kv_heads, dtype=torch.int8, device=device)
        self.slots = torch.arange(max_rows, dtype=torch.int32, device=device)
        self._prepared: dict[tuple, object] = {}  # csrc.route.Router per (block size, pooling): checked once
        self._epilogue_checked = False

    def _launcher(self, key_cache: torch.Tensor, cfg: ElasticConfig):
        from elastic_vllm.csrc.route import Router, check_key_cache

        key = (key_cache.shape[1], key_cache.shape[2], key_cache.shape[3], cfg.pool_tokens, cfg.pooling)
        r = self._prepared.get(key)
        if r is None:
            check_key_cache(key_cache)
            r = self._prepared[key] = Router(
                self.weights, self.scratch, inv_freq=self.inv_freq, num_kv_heads=key_cache.shape[2],
                head_dim=key_cache.shape[3], block_size=key_cache.shape[1], attention_scaling=self.scaling,
                pool_tokens=cfg.pool_tokens, pooling=cfg.pooling, norm=self.norm,
            )  # fmt: skip
        return r

    def route_into(self, layer: int, key_cache: torch.Tensor, rb: RouteBatch, cfg: ElasticConfig, tables) -> None:
        """Route the rows of ``rb`` at ``layer`` and write the engine's tables from the kernel itself: the
        glue of :func:`route_layer` + ``EngineState.route`` (forced rows, decision -> mode, decode-phase
        modes, this step's row modes, the per-request tables of final routings) in the router's finishing
        program, two launches per layer instead of ~14 small ops. ``tables``: (row_modes [L, B, Hkv],
        table_modes, table_fa, table_logits) of the engine state. Rows sharing one bias give the kernel one margin
        (the server's less that bias); rows with different biases give it a threshold per row (``neg_margins``);
        rows with a fixed SA budget use :func:`route_layer` (``RouteBatch.needs_glue``)."""
        from elastic_vllm.csrc.route import RouteEpilogue, check_epilogue

        R = rb.rows.numel()
        row_modes, t_modes, t_fa, t_logits = tables
        if rb.biases is not None and rb.neg_margins is None:  # once per step: the rows' own thresholds
            rb.neg_margins = (rb.biases - cfg.sa_margin).float().view(-1).contiguous()
        ep = RouteEpilogue(
            rows=rb.rows_i32, force=rb.force, decode_phase=rb.decode_phase, final_slot=rb.final_slot_row,
            row_modes=row_modes, table_modes=t_modes, table_fa=t_fa, table_logits=t_logits,
            decode_dense=cfg.decode_mode == "dense", neg_margins=rb.neg_margins,
        )  # fmt: skip
        if not self._epilogue_checked:  # the engine's tables and RouteBatch dtypes never change: once
            check_epilogue(ep, R, row_modes.shape[0], row_modes.shape[2], key_cache.device)
            self._epilogue_checked = True
        self._launcher(key_cache, cfg)(
            key_cache, rb.block_table, rb.rows_i32, rb.ends, self.slots[:R], layer, epilogue=ep,
            fa_value=int(cfg.fa_mode), sa_value=int(cfg.sa_mode),
            sa_margin=effective_margin(cfg.sa_margin, rb.uniform_bias or 0.0),
        )  # fmt: skip

    def logits(self, layer: int, key_cache: torch.Tensor, rb: RouteBatch, cfg: ElasticConfig) -> torch.Tensor:
        """Router logits [R, Hkv, 2] of the rows of ``rb`` at ``layer``: two kernel launches through a
        launcher validated once (the checked ``csrc.route.route`` re-validated and rebuilt it per layer)."""
        R = rb.rows.numel()
        out = torch.empty(R, key_cache.shape[2], 2, dtype=torch.float32, device=key_cache.device)
        self._launcher(key_cache, cfg)(key_cache, rb.block_table, rb.rows_i32, rb.ends, self.slots[:R], layer, out)
        return out
