"""Per-engine state of the elastic backend: configuration, router, routing table, request lifecycle.

One file of ~460 lines (a third docstrings) because :class:`EngineState` is the one object the runner hooks,
the metadata builder and every layer's forward share within a step (its step plan, budget tables and routing glue
read one another's fields); what needs none of that lives apart: the requests and their slots (``requests.py``),
the configuration and model checks (``precheck.py``), recording (``recording.py``), the parallel layout
(``parallel.py``), router discovery (``router/discovery.py``).

One :class:`EngineState` per vLLM engine (per worker process and VllmConfig). It is created by the
first ``ElasticAttentionImpl`` (model construction: configuration and router are checked before any
weight loads), gets its device buffers from the metadata builder, and follows requests through the
model-runner hooks of ``compat.install_runner_hooks``.

Per-request state (both model runners)::

    routing table (device)   table_modes  [S, L, Hkv] int8   HeadMode of prefill queries (final routing)
                             table_fa     [S, L, Hkv] bool   router decision, True = FA
                             table_logits [S, L, Hkv, 2]     router logits
    per step (device)        row_modes    [L, B, Hkv] int32  what every layer's kernel reads
    host                     requests: ``requests.Requests`` (req_id -> RequestState, slots, the lifecycle)

    rows   the request id of each batch row, recorded by the runner hook in row order each step.

When a row is routed (its request has no final routing yet):

- the step reaches the end of the prompt (``seq_len >= prompt_len``), whatever its q_len (a chunk, a
  whole prompt, or the 1-token "prefill" of a full prefix-cache hit): FINAL routing over the prompt's
  boundary keys, written to the table, recorded once (``observe.on_routing_final``), reused for every
  later step of the request;
- a chunk that ends before the prompt does (chunked prefill): ``chunk_routing="prefix"`` routes it
  over the boundary of the prefix processed so far (tokens [0, end of this chunk)), for this chunk
  only; ``"dense"`` runs it with every head FA. Requests forced to all-FA / all-SA use their force.

The boundary keys are always read from the paged cache, so prefix-cache hits (first chunk starting
past token 0) take the same path. Rows whose queries lie past the prompt (decode, or tokens
recomputed after preemption) use ``decode_mode``: dense -> every head FA, sparse -> SSA heads keep
sink + window (XA heads dense).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.reference.rope import RopeSpec
from elastic_vllm.router.checkpoint import (
    BackboneShape,
    load_router,
)
from elastic_vllm.router.discovery import resolve_router_path
from elastic_vllm.router.model import budget_sa_counts
from elastic_vllm.router.policy import RoutingTables, decode_modes, describe_floor, floor_of
from elastic_vllm.vllm_plugin import compat, observe, parallel
from elastic_vllm.vllm_plugin.ops import AttnParams, resolve_ops
from elastic_vllm.vllm_plugin.parallel import global_kv_heads, is_first_replica
from elastic_vllm.vllm_plugin.precheck import check_model_support, parse_additional_config
from elastic_vllm.vllm_plugin.recording import Recorder, StepTimer
from elastic_vllm.vllm_plugin.requests import Requests, RequestState
from elastic_vllm.vllm_plugin.routing import RouteBatch, RouteRow, TritonRouter, build_route_batch, route_layer

logger = logging.getLogger("elastic_vllm.vllm_plugin")

RECORD_POOLED_ENV = "ELASTIC_VLLM_RECORD_POOLED"
# Hybrid prefill steps whose longest row reaches this many tokens run their FA heads on vLLM's FlashAttention
# (``ops.fa_heads_attention``: Hkv calls per layer); shorter ones keep every head in the one hybrid launch.
# benchmarks/results/fa-split-h100.json (one layer, split vs fused, SA shares 0-0.75): the Llama-3.1-8B shape
# (d128, 8 KV heads) gains from 16K at every share (2 of 8 heads FA: 1.41 vs 1.61 ms at 16K context), is level at
# 8K-12K (0.93 vs 0.93 ms, 0.75 vs 0.74 ms) and loses at 4K (0.52 vs 0.39 ms: the Hkv extra launches); the demo
# shape (d64, 3 KV heads) loses until 32K, past its 8K context. 16K: the d128 gain is clear (>= 1.14x) at every
# share, where 8K-12K would trade a tie for a loss on d64 models.
FA_SPLIT_MIN_SEQ = 16384
# Budget tables kept (elastic_target_omega / target_omega): clients choose the floats, so the cache must not grow
# with them; each table is L ints and an evicted one is rebuilt on its next use.
BUDGET_TABLES = 64


def row_is_dense(cfg: ElasticConfig, seq_len: int, force: str, decode_phase: bool) -> bool:
    """True when every KV head of a row computes exactly full causal attention at this step, whatever the
    router decides: the step can then run vLLM's FlashAttention kernel instead of the hybrid one.

    - FA-SSA only (an XA head drops blocks even in a short sequence);
    - ``seq_len <= sink + window``: a streaming head sees every causal key (a key j <= i is hidden only when
      j >= sink and i - j >= window, i.e. i >= sink + window), so SSA == FA, for prompt and decode queries;
    - decode queries with ``decode_mode="dense"``, or of a request forced all-FA: every head FA;
    - prompt queries of a request forced all-FA."""
    if cfg.mode != "FA-SSA":
        return False
    if seq_len <= cfg.sink + cfg.window:
        return True
    return (decode_phase and cfg.decode_mode == "dense") or force == "all-FA"


@dataclass
class StepPlan:
    """What build() decided for this step (host side)."""

    route: RouteBatch | None
    rows: list[RequestState | None]
    query_start_loc: list[int]
    seq_lens: list[int]
    dense: bool = False  # every head of every row is full attention: vLLM's FlashAttention runs the step
    fa_split: bool = False  # the prompt rows' FA heads on vLLM's FlashAttention, the other heads on ours


class EngineState(compat.RunnerObserver):
    def __init__(self, vllm_config) -> None:
        self._config_ref = weakref.ref(vllm_config)
        self.cfg, ops_requested = parse_additional_config(vllm_config)
        mc = vllm_config.model_config
        self.model_name = compat.served_model_name(vllm_config)
        hf = mc.hf_config
        check_model_support(vllm_config)
        self.shape = BackboneShape.from_hf_config(hf)
        self.rope = RopeSpec.from_hf_config(hf)
        self.num_layers = self.shape.num_layers
        self.tp_rank, self.tp_size = compat.tp_rank_and_size()
        self.num_kv_heads = mc.get_num_kv_heads(vllm_config.parallel_config)
        self.kv_heads = tuple(global_kv_heads(self.tp_rank, self.tp_size, self.shape.num_kv_heads))
        if len(self.kv_heads) != self.num_kv_heads:
            raise RuntimeError(f"elastic: rank holds {self.num_kv_heads} KV heads, expected {len(self.kv_heads)}")
        self.first_replica = is_first_replica(self.tp_rank, self.tp_size, self.shape.num_kv_heads)
        self.topo = parallel.topology(self.num_layers)  # pipeline stage: the layers [first, end) it routes
        self.device = torch.device(vllm_config.device_config.device)
        self.ops = resolve_ops(ops_requested, self.device)
        if self.ops == "triton":
            from elastic_vllm.vllm_plugin.ops import triton_kernels

            triton_kernels()  # fail at startup, naming the problem, when the kernels cannot load
        self.router = None
        self.router_path = None
        self._load_router()
        # the fa_floor mask of the whole model [L, all KV heads] (None: off); this rank keeps its KV heads' columns
        self.floor_heads = floor_of(self.router, self.cfg, self.router_path)
        self.params = AttnParams(
            scale=0.0,  # set per layer by the impl
            sink=self.cfg.sink,
            window=self.cfg.window,
            xattn_stride=self.cfg.xattn_stride,
            xattn_block=self.cfg.xattn_block,
            xattn_threshold=self.cfg.xattn_threshold,
        )
        self.record_pooled = os.environ.get(RECORD_POOLED_ENV, "0") not in ("", "0")
        self.use_v2_runner = compat.uses_v2_model_runner(vllm_config)
        self.requests = Requests(self.cfg)
        self.budget_tables: dict[float, list[int]] = {}  # target -> SA heads per layer (this rank)
        self.rows: list[str | None] | None = None
        self.in_step = False
        self.plan: StepPlan | None = None
        self.attached = False
        self.dense_attention = None  # vLLM's FlashAttention for all-FA steps (set by warmup after its check)
        self.fa_heads_attention = None  # the same kernel for the FA heads of hybrid steps (warmup's check too)
        self.warmed = False
        self._live_published = -1  # last value of the elastic:live_requests gauge
        self.step_id = 0  # execute_model calls with a scheduler output (the recorder's step order)
        self.recorder = Recorder(
            self.cfg, self.model_name, self.topo, self.kv_heads, self.first_replica, self.router_path
        )
        logger.info(
            "elastic attention: %s, router %s, %s, ops=%s, %s, KV heads %s",
            self.cfg.model_dump(exclude={"router_path"}),
            self.router_path or f"none (force {self.cfg.force})",
            describe_floor(self.router, self.cfg, self.floor_heads),
            self.ops,
            self.topo.describe(),
            list(self.kv_heads),
        )

    # --- setup ------------------------------------------------------------------------------
    def _load_router(self) -> None:
        path = resolve_router_path(self.cfg, self.shape, self.model_name)
        if path is None:
            return
        # vLLM builds the model (and so this state) under the model's default dtype, e.g. bf16: the
        # router is float32 whatever the backbone dtype, so its modules must be created in float32
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            ck = load_router(path, expect=self.shape, model_name=self.model_name, device=self.device)
        finally:
            torch.set_default_dtype(dtype)
        self.router = ck.router
        self.router_path = str(ck.path)

    def attach(self, device: torch.device, max_rows: int, max_slots: int, block_size: int) -> None:
        """Allocate the device buffers (called by the metadata builder, once per engine)."""
        if self.attached:
            if block_size != self.block_size:
                raise RuntimeError("elastic: layers with different KV block sizes are not supported")
            return
        self.device = device
        self.block_size = block_size
        if self.router is not None:
            self.router.to(device)
        L, H = self.num_layers, self.num_kv_heads
        self.num_slots = max_slots + 1  # slot S-1: reserved, all FA
        self.dense_slot = self.num_slots - 1
        self.max_rows = max_rows
        self.table_modes = torch.zeros(self.num_slots, L, H, dtype=torch.int8, device=device)
        self.table_fa = torch.zeros(self.num_slots, L, H, dtype=torch.bool, device=device)
        self.table_logits = torch.zeros(self.num_slots, L, H, 2, dtype=torch.float32, device=device)
        self.table_pooled = (
            torch.zeros(self.num_slots, L, H, self.shape.head_dim, dtype=torch.float32, device=device)
            if self.record_pooled
            else None
        )
        self.row_modes = torch.zeros(L, max_rows, H, dtype=torch.int32, device=device)
        self.tables = RoutingTables(
            self.row_modes, self.table_modes, self.table_fa, self.table_logits, self.table_pooled
        )
        # the fa_floor mask of this rank's KV heads, [L, Hkv] int8 (all 0: no floor); with pipeline parallelism the
        # tables keep the global layer index, so a stage reads its own layers' rows
        self.floor = torch.zeros(L, H, dtype=torch.int8, device=device)
        self.has_floor = self.floor_heads is not None and bool(self.floor_heads[:, list(self.kv_heads)].any())
        if self.floor_heads is not None:
            self.floor.copy_(self.floor_heads[:, list(self.kv_heads)].to(torch.int8))
        self.requests.size_slots(self.num_slots)
        self.timer = StepTimer(device)
        self.kernel_router = (
            TritonRouter(self.router, self.rope, L, H, max_rows, device)
            if self.ops == "triton" and self.router is not None
            else None
        )
        self.attached = True

    # --- request lifecycle (RunnerObserver) -----------------------------------------------------
    def on_step_begin(self, so) -> None:
        self.in_step = True
        self.step_id += 1
        self.plan = None
        self.rows = None
        if self.attached:
            self.timer = StepTimer(self.device)
        self.requests.begin_step(so)
        self._publish_live()

    def _publish_live(self) -> None:
        """elastic:live_requests = requests holding state here (0 when idle); metrics never take the engine down."""
        if len(self.requests) == self._live_published or not self.topo.last_stage:
            return  # every pipeline stage holds the same requests: the last one publishes them
        self._live_published = len(self.requests)
        try:
            from elastic_vllm.telemetry.metrics import set_live_requests

            set_live_requests(self.model_name, self.tp_rank, self._live_published)
        except Exception:
            logger.exception("elastic-vllm: recording elastic:live_requests failed")

    def on_rows(self, req_ids: list[str | None]) -> None:
        self.rows = req_ids

    def on_step_end(self, failed: bool = False) -> None:
        try:
            if failed and (self.tp_size > 1 or self.topo.pp_size > 1):
                # the engine is going down; a rank that failed before its forward must not wait in the
                # TP gather or the stage exchange of the recording for ranks that never reach it
                for st in self.requests.values():
                    st.pending = False
            else:
                self.flush()
            observe.publish_counters()
        finally:
            self.in_step = False
            self.rows = None
            self.plan = None
            self.requests.end_step()

    def needs_eager_attention(self) -> bool:
        return self.requests.needs_eager_attention()

    def live_request_ids(self) -> list[str]:
        return list(self.requests)

    # --- per step (builder) ----------------------------------------------------------------------
    def plan_step(self, common) -> StepPlan:
        """Decide every row's modes for this step; fill ``row_modes`` for rows with a final routing."""
        B = int(common.num_reqs)
        if B > self.max_rows:
            raise RuntimeError(f"elastic: batch of {B} rows exceeds the {self.max_rows} rows the backend sized for")
        qsl = common.query_start_loc_cpu[: B + 1].tolist()
        rows = self.rows if (self.in_step and self.rows is not None) else []
        req_idx = getattr(common, "req_idx", None)
        states: list[RequestState | None] = []
        slot_of_row = [self.dense_slot] * B
        decode_row = [False] * B
        route_rows: list[RouteRow] = []
        dense = True  # rows without a request or not routed read the reserved all-FA slot
        for b in range(B):
            q_len = qsl[b + 1] - qsl[b]
            st = self.requests.get(rows[b]) if b < len(rows) and rows[b] is not None else None
            if st is None or q_len == 0:
                states.append(None)
                continue
            scheduled = self.requests.step_tokens[st.req_id]
            seq_len = self.requests.step_computed[st.req_id] + scheduled
            if scheduled != q_len:
                raise RuntimeError(
                    f"elastic: row {b} ({st.req_id}) has {q_len} queries but the scheduler gave it {scheduled} tokens"
                )
            states.append(st)
            start = seq_len - q_len
            decode_phase = start >= st.prompt_len
            slot = int(req_idx[b]) if req_idx is not None else self.requests.slot(st)
            routed = True
            if st.final:
                slot_of_row[b] = st.table_slot
                decode_row[b] = decode_phase
            elif seq_len >= st.prompt_len:
                route_rows.append(RouteRow(b, st.prompt_len, st.force, decode_phase, slot, st.bias, st.target))
                st.table_slot = slot
                st.final = True
                st.pending = True
            elif st.force != "auto" or self.cfg.chunk_routing == "prefix":
                route_rows.append(RouteRow(b, seq_len, st.force, False, None, st.bias, st.target))
            else:
                routed = False  # a chunk before the prompt's end under chunk_routing="dense": all FA
            if routed and dense:
                dense = row_is_dense(self.cfg, seq_len, st.force, decode_phase)
        # rows with a final routing (and dummy rows: the reserved all-FA slot) from the table
        idx = torch.tensor(slot_of_row, dtype=torch.long).to(self.device, non_blocking=True)
        modes = self.table_modes.index_select(0, idx)  # [B, L, H]
        if any(decode_row):
            dec = torch.tensor(decode_row, dtype=torch.bool).to(self.device, non_blocking=True)
            modes = torch.where(dec[:, None, None], decode_modes(modes, self.cfg.decode_mode), modes)
        self.row_modes[:, :B].copy_(modes.transpose(0, 1))
        route = None
        if route_rows and any(slot != self.dense_slot for slot in slot_of_row):
            observe.COUNTERS.mixed_steps += 1
        if route_rows:
            route = build_route_batch(
                route_rows,
                common.block_table_tensor,
                self.block_size,
                self.cfg.pooling,
                self.cfg.pool_tokens,
                budget_sa=self.budget_counts,
            )
            observe.COUNTERS.routed_rows += len(route_rows)
        # decode-only steps keep the decode kernel: they replay FULL CUDA graphs, captured from it
        prompt_rows = int(common.max_query_len) > 1
        dense = dense and self.dense_attention is not None and prompt_rows
        fa_split = (
            not dense
            and prompt_rows
            and self.fa_heads_attention is not None
            and self.cfg.fa_mode == HeadMode.FA
            and int(common.max_seq_len) >= FA_SPLIT_MIN_SEQ
        )
        if dense:
            observe.COUNTERS.dense_steps += 1
        if fa_split:
            observe.COUNTERS.fa_split_steps += 1
        self.plan = StepPlan(
            route=route, rows=states, query_start_loc=qsl, seq_lens=self._host_seq_lens(common, B), dense=dense,
            fa_split=fa_split,
        )  # fmt: skip
        return self.plan

    @staticmethod
    def _host_seq_lens(common, B: int) -> list[int]:
        """Host seq_lens for the torch path: free on CPU; the exact-for-prefill upper bound elsewhere."""
        if common.seq_lens.device.type == "cpu":
            return common.seq_lens[:B].tolist()
        ub = getattr(common, "seq_lens_cpu_upper_bound", None)
        return ub[:B].tolist() if ub is not None else common.seq_lens[:B].tolist()

    def budget_counts(self, target: float) -> list[int]:
        """SA heads per layer of this rank's KV heads for a fixed budget ``target`` (``budget_sa_counts``): the
        ranks' head groups are contiguous blocks of ``len(kv_heads)`` global heads (replicated heads: one group
        per head, and its replicas decide the same). The last BUDGET_TABLES targets are cached."""
        counts = self.budget_tables.get(target)
        if counts is None:
            g = len(self.kv_heads)
            groups = self.shape.num_kv_heads // g
            counts = self.budget_tables[target] = budget_sa_counts(
                target, self.num_layers, self.kv_heads[0] // g, groups, g
            )
            while len(self.budget_tables) > BUDGET_TABLES:
                self.budget_tables.pop(next(iter(self.budget_tables)))
        return counts

    # --- per layer (impl.forward) ----------------------------------------------------------------
    def route(self, layer: int, key_cache: torch.Tensor, rb: RouteBatch) -> None:
        t0 = self.timer.start()
        if self.kernel_router is not None and rb.any_auto and not rb.needs_glue:
            # the fused path: the router kernel writes the tables itself
            self.kernel_router.route_into(layer, key_cache, rb, self.cfg, self.tables, self.floor)
            observe.COUNTERS.fused_route_layers += 1
        else:
            logits, routing, pooled = route_layer(
                layer, key_cache, rb, self.router, self.rope, self.cfg, self.num_kv_heads, self.kernel_router,
                self.floor if self.has_floor else None,
            )  # fmt: skip
            self.tables.write(layer, rb.rows, rb.final_idx, rb.final_slots, routing, logits, pooled)
        self.timer.stop(t0)

    def on_xa_mask(self, layer: int, row: int, head: int, q_start: int, q_end: int, mask: torch.Tensor) -> None:
        """XA selections of prompt queries (torch path), kept for Omega_ESR of the final routing.
        mask: bool [nb, nb] over absolute blocks of the row's sequence; rows of this step's queries."""
        st = self.plan.rows[row] if self.plan is not None and row < len(self.plan.rows) else None
        if st is None or q_start >= st.prompt_len:
            return
        blk = self.cfg.xattn_block
        nb = (st.prompt_len + blk - 1) // blk
        sel = st.xa_rows.setdefault((layer, head), torch.zeros(nb, nb, dtype=torch.bool))
        a, b = q_start // blk, (min(q_end, st.prompt_len) - 1) // blk
        c = min(mask.shape[1], nb)
        sel[a : b + 1, :c] |= mask[a : b + 1, :c].to("cpu", torch.bool)

    # --- recording ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Snapshot the routings made final in this step, for :class:`recording.Recorder` to record once
        per request (when the step's output is read; with tensor parallelism, now)."""
        pending = [st for st in list(self.requests.values()) if st.pending]
        self.recorder.drain(upto=self.step_id - 2)  # left behind by a runner whose output hook did not run
        if not pending:
            return
        for st in pending:
            st.pending = False
        tables = (self.table_fa, self.table_modes, self.table_logits, self.table_pooled)
        self.recorder.snapshot(pending, tables, self.timer, self.step_id)

    def on_step_output(self) -> Callable[[], None]:
        """Called when the runner has launched the step's sampling: what to call once its output is read
        (the forward is complete then, so recording its snapshot does not wait)."""
        return functools.partial(self.recorder.drain, upto=self.step_id)


# --- registry: one state per engine --------------------------------------------------------------
_STATES: dict[int, EngineState] = {}


def for_config(vllm_config, create: bool = True) -> EngineState | None:
    """The EngineState of ``vllm_config`` (created on first use when ``create``)."""
    st = _STATES.get(id(vllm_config))
    if st is not None and st._config_ref() is vllm_config:
        return st
    if not create:
        return None
    st = EngineState(vllm_config)
    _STATES[id(vllm_config)] = st
    for key in [k for k, s in _STATES.items() if s._config_ref() is None]:
        del _STATES[key]
    return st


def for_runner(runner) -> EngineState | None:
    cfg = getattr(runner, "vllm_config", None)
    return for_config(cfg, create=False) if cfg is not None else None


def live_states() -> list[EngineState]:
    return [s for s in _STATES.values() if s._config_ref() is not None]
