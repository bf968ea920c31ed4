"""Routing inside the vLLM backend: boundary keys from the paged cache -> pre-RoPE -> router.

The paged cache holds POST-RoPE keys (post k_norm for Qwen3); the router wants PRE-RoPE keys. The
boundary keys of a request (first/last ``pool_tokens`` of the routed prefix, ``boundary_positions``)
are gathered from the cache and rotated back with the model's own RoPE (``reference.rope``)::

    key_cache [num_blocks, block_size, Hkv, D] --gather(block_table, positions)--> [N, Hkv, D]
      --invert_rope--> pre-RoPE [N, Hkv, D] --segment mean per row--> pooled [R, Hkv, D]
      --router layer l--> logits [R, Hkv, 2] --policy.route_heads--> HeadMode [R, Hkv]

Everything here is plain torch on the cache's device, built once per step (:func:`build_route_batch`)
and reused by every layer (:func:`route_layer`): a few small kernels per layer, none per row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elastic_vllm import ops as kernels
from elastic_vllm.config import ElasticConfig
from elastic_vllm.reference.rope import RopeSpec, invert_rope
from elastic_vllm.router.model import ElasticRouter, boundary_positions
from elastic_vllm.router.policy import FORCE_CODE, HeadRouting, RoutingTables, decode_modes, route_heads, thresholds

if kernels.AVAILABLE:  # the one check: the torch glue routes without Triton
    from elastic_vllm.ops.route import kernel as route_kernel

__all__ = ["FORCE_CODE", "RouteBatch", "RouteRow", "TritonRouter", "build_route_batch", "decode_modes", "route_layer"]


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


@dataclass(frozen=True)
class PoolIndex:
    """Where the N pooled tokens of the R routing rows sit in the paged cache."""

    token_row: torch.Tensor  # [N] long: routing row of each pooled token
    token_pos: torch.Tensor  # [N] long: position of each pooled token
    token_slot: torch.Tensor  # [N] long: flat cache slot (block * block_size + offset)
    inv_count: torch.Tensor  # [R, 1, 1] float32: 1 / pooled tokens of each row


@dataclass
class RouteBatch:
    """This step's R routing rows: host rows, and the device tensors every layer's routing reads."""

    host: list[RouteRow]
    block_table: torch.Tensor  # [B, max_blocks] int32 of this step
    ends: torch.Tensor  # [R] int32: routed prefix length of each row
    # [4, R] int32: batch row, force code, decode phase (0 / 1), routing-table slot if final else -1 (one copy
    # per step; the router kernel's epilogue reads it as is)
    row_info: torch.Tensor
    rows: torch.Tensor  # [R] long: batch rows (the glue's index_copy)
    final_idx: torch.Tensor  # [F] long: routing rows whose routing is final
    final_slots: torch.Tensor  # [F] long: their routing-table slots
    pool: PoolIndex
    biases: torch.Tensor  # [R] float64: each row's routing bias
    budget: torch.Tensor | None = None  # [R, L] long: SA heads per layer of rows with a target (this rank's), else -1
    _thresholds: dict[float, torch.Tensor] = field(default_factory=dict, repr=False)

    # host facts of the rows, so the per-layer glue launches no op that would change nothing (H200 e2e:
    # the router-step time of an 8K prefill was 12-14 ms before, 1.5-2.2 ms with these and the faster kernel)
    @functools.cached_property
    def any_auto(self) -> bool:
        """Some row needs the router (not every row forced)."""
        return any(r.force == "auto" for r in self.host)

    @functools.cached_property
    def any_forced(self) -> bool:
        return any(r.force != "auto" for r in self.host)

    @functools.cached_property
    def any_decode_phase(self) -> bool:
        return any(r.decode_phase for r in self.host)

    @functools.cached_property
    def uniform_bias(self) -> float | None:
        """The bias every row shares, or None when rows differ."""
        biases = {r.bias for r in self.host}
        return next(iter(biases)) if len(biases) == 1 else None

    @property
    def rows_i32(self) -> torch.Tensor:
        return self.row_info[0]

    @property
    def force(self) -> torch.Tensor:
        return self.row_info[1]

    @property
    def decode_phase(self) -> torch.Tensor:
        return self.row_info[2]

    @property
    def needs_glue(self) -> bool:
        """Some row's decisions are not the fused kernel's (row, head) rule: budgets (a budget ranks the heads
        of a row, which one (row, head) program cannot) run through :func:`route_layer`."""
        return self.budget is not None

    def thresholds(self, sa_margin: float) -> torch.Tensor:
        """[R] float32 thresholds of the rows (``policy.thresholds``), made once per step."""
        thr = self._thresholds.get(sa_margin)
        if thr is None:
            thr = self._thresholds[sa_margin] = thresholds(self.biases, sa_margin).contiguous()
        return thr


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
    budget = None
    if any(r.target is not None for r in rows):
        if budget_sa is None:
            raise RuntimeError("elastic: a routing row has a target but no budget_sa function was given")
        per_row = [budget_sa(r.target) if r.target is not None else None for r in rows]
        L = len(next(c for c in per_row if c is not None))
        budget = torch.tensor([c if c is not None else [-1] * L for c in per_row], dtype=torch.long)
        budget = budget.to(dev, non_blocking=True)
    info = [
        [r.row for r in rows],
        [FORCE_CODE[r.force] for r in rows],
        [int(r.decode_phase) for r in rows],
        [-1 if r.final_slot is None else r.final_slot for r in rows],
    ]
    return RouteBatch(
        host=rows,
        block_table=block_table,
        ends=torch.tensor([r.end for r in rows], dtype=torch.int32).to(dev, non_blocking=True),
        row_info=torch.tensor(info, dtype=torch.int32).to(dev, non_blocking=True),
        rows=batch_rows,
        final_idx=torch.tensor([i for i, _ in final], dtype=torch.long).to(dev, non_blocking=True),
        final_slots=torch.tensor([s for _, s in final], dtype=torch.long).to(dev, non_blocking=True),
        pool=PoolIndex(
            token_row=token_row,
            token_pos=pos,
            token_slot=blocks * block_size + pos % block_size,
            inv_count=(1.0 / counts).view(-1, 1, 1).to(dev, non_blocking=True),
        ),
        biases=torch.tensor([r.bias for r in rows], dtype=torch.float64).to(dev, non_blocking=True),
        budget=budget,
    )


def pooled_prerope_keys(key_cache: torch.Tensor, rb: RouteBatch, rope: RopeSpec) -> torch.Tensor:
    """Pooled pre-RoPE keys [R, Hkv, D] (float32) of the routing rows, read from the paged cache."""
    ix = rb.pool
    k = key_cache.flatten(0, 1).index_select(0, ix.token_slot)  # [N, Hkv, D], post-RoPE
    k = invert_rope(k, ix.token_pos, rope)  # float32
    R = rb.rows.numel()
    pooled = torch.zeros(R, k.shape[1], k.shape[2], dtype=torch.float32, device=k.device)
    pooled.index_add_(0, ix.token_row, k)
    return pooled * ix.inv_count


def route_layer(
    layer: int,
    key_cache: torch.Tensor,
    rb: RouteBatch,
    router: ElasticRouter | None,
    rope: RopeSpec,
    cfg: ElasticConfig,
    num_kv_heads: int,
    kernel: TritonRouter | None = None,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HeadRouting, torch.Tensor | None]:
    """Route the rows of ``rb`` at ``layer`` through ``policy.route_heads`` (with ``kernel``: logits from the
    fused Triton router). ``floor``: [L, Hkv] bool or int8 fa_floor mask of this rank's heads, or None.

    Returns (logits [R, Hkv, 2] float32 (zeros where no router ran), the rows' ``HeadRouting``,
    pooled [R, Hkv, D] or None (forced rows, Triton router)).
    """
    R = rb.rows.numel()
    pooled = None
    logits = None
    if rb.any_auto:
        if router is None:
            raise RuntimeError("elastic: a request needs the router but none is loaded")
        if kernel is not None:
            logits = kernel.logits(layer, key_cache, rb, cfg)
        else:
            pooled = pooled_prerope_keys(key_cache, rb, rope)
            with torch.no_grad():
                logits = router(layer, pooled)
    routing = route_heads(
        logits, cfg, num_heads=num_kv_heads, force=rb.force if rb.any_forced else "auto", bias=rb.biases,
        budget=None if rb.budget is None else rb.budget[:, layer],
        floor=None if floor is None else floor[layer].bool(),
        decode_phase=rb.decode_phase if rb.any_decode_phase else None,
    )  # fmt: skip
    if logits is None:
        logits = torch.zeros(R, num_kv_heads, 2, dtype=torch.float32, device=key_cache.device)
    return logits, routing, pooled


class TritonRouter:
    """The fused router kernel (``elastic_vllm.ops.route.kernel``): gather, RoPE inversion, pooling and both
    MLPs of all routing rows of one layer in one launch; its logits feed the same decision code."""

    def __init__(
        self, router: ElasticRouter, rope: RopeSpec, num_layers: int, num_kv_heads: int, max_rows: int, device
    ):
        self.weights = route_kernel.pack_router_weights(router).to(device).contiguous()
        norm = route_kernel.pack_router_norm(router)  # the router's input standardization, if it has one
        self.norm = None if norm is None else norm.to(device).contiguous()
        self.inv_freq = rope.inv_freq.to(device, torch.float32)
        self.scaling = float(rope.attention_scaling)
        # the kernel also writes decisions into a table; ours come from its logits, so a scratch one
        self.scratch = torch.zeros(max_rows, num_layers, num_kv_heads, dtype=torch.int8, device=device)
        self.no_floor = torch.zeros(num_layers, num_kv_heads, dtype=torch.int8, device=device)
        self.slots = torch.arange(max_rows, dtype=torch.int32, device=device)
        self._prepared: dict[tuple, object] = {}  # route_kernel.Router per (block size, pooling): checked once
        self._epilogue_checked = False

    def _launcher(self, key_cache: torch.Tensor, cfg: ElasticConfig):
        key = (key_cache.shape[1], key_cache.shape[2], key_cache.shape[3], cfg.pool_tokens, cfg.pooling)
        r = self._prepared.get(key)
        if r is None:
            route_kernel.check_key_cache(key_cache)
            r = self._prepared[key] = route_kernel.Router(
                self.weights, self.scratch, inv_freq=self.inv_freq, num_kv_heads=key_cache.shape[2],
                head_dim=key_cache.shape[3], block_size=key_cache.shape[1], attention_scaling=self.scaling,
                pool_tokens=cfg.pool_tokens, pooling=cfg.pooling, norm=self.norm,
            )  # fmt: skip
        return r

    def route_into(
        self, layer: int, key_cache: torch.Tensor, rb: RouteBatch, cfg: ElasticConfig, tables: RoutingTables,
        floor: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Route the rows of ``rb`` at ``layer`` and write ``tables`` from the kernel itself: the routing policy
        (``policy.route_heads`` without budgets: each row's threshold, the ``floor`` [L, Hkv] int8 mask (None:
        none), forced
        rows, decode-phase modes) and ``RoutingTables.write`` in the router's finishing program, two launches
        per layer instead of ~14 small ops. Rows with a fixed SA budget use :func:`route_layer`
        (``RouteBatch.needs_glue``)."""
        R = rb.rows.numel()
        ep = route_kernel.RouteEpilogue(
            row_info=rb.row_info, thresholds=rb.thresholds(cfg.sa_margin), floor=self.no_floor if floor is None else floor,
            tables=tables,
            decode_dense=cfg.decode_mode == "dense",
        )  # fmt: skip
        if not self._epilogue_checked:  # the engine's tables and RouteBatch dtypes never change: once
            route_kernel.check_epilogue(ep, R, tables.step_modes.shape[0], tables.step_modes.shape[2], key_cache.device)
            self._epilogue_checked = True
        self._launcher(key_cache, cfg)(
            key_cache, rb.block_table, rb.rows_i32, rb.ends, self.slots[:R], layer, epilogue=ep,
            fa_value=int(cfg.fa_mode), sa_value=int(cfg.sa_mode),
        )  # fmt: skip

    def logits(self, layer: int, key_cache: torch.Tensor, rb: RouteBatch, cfg: ElasticConfig) -> torch.Tensor:
        """Router logits [R, Hkv, 2] of the rows of ``rb`` at ``layer``: two kernel launches through a
        launcher validated once (the checked ``ops.route.kernel.route`` re-validated and rebuilt it per layer)."""
        R = rb.rows.numel()
        out = torch.empty(R, key_cache.shape[2], 2, dtype=torch.float32, device=key_cache.device)
        self._launcher(key_cache, cfg)(key_cache, rb.block_table, rb.rows_i32, rb.ends, self.slots[:R], layer, out)
        return out
