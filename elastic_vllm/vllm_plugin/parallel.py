"""Tensor, pipeline and data parallelism of the elastic backend: which layers and KV heads a rank routes, which
rank records what, and how a request's Omegas over every layer and KV head reach the rank that records them.

- Tensor parallel (TP): each rank holds some KV heads of every layer of its stage and routes them. The ranks of
  a stage exchange per-request :class:`HeadCounts` over vLLM's TP group (a gloo all-gather at step end: every
  TP rank runs the same step at the same time, their forward needs each other's all-reduces).
- Pipeline parallel (PP): a stage holds a contiguous range of layers (vLLM's ``get_pp_indices``, the split its
  ``make_layers`` uses) and routes those; its routing tables keep the global layer index (rows of other stages'
  layers stay unused). The counts of stage s reach the LAST stage by a point-to-point message from rank
  (s, t) to rank (last, t) that the sender does not wait for; the last stage then runs the TP all-gather.
  Not a collective over the PP group: vLLM's worker sends a stage's activations to the next stage after the
  model runner's ``execute_model`` returns (``gpu_worker.execute_model``), i.e. after our step end; a stage
  waiting there for a later stage would wait for a step that its own unsent activations hold back: deadlock.
  The last stage's receive waits for a message its sender posted right after the forward whose activations
  the receiver has already consumed, so it returns at once. Every stage runs the same SchedulerOutputs in the
  same order (one queue per worker; with micro-batches in flight, the batch queue, stages run different steps
  at the same time but each in that order), so the requests whose routing becomes final at step k are the same
  on every stage and message k pairs with step k; the request ids in it are checked.
- Data parallel (DP): each replica is its own engine with its own workers, and records its own requests.
  prometheus_client's multiprocess mode sums counters and histograms over processes, so /metrics shows the
  sum over replicas (and ``livesum`` for the live-requests gauge).

Who records what (see docs/scaling.md for the queries):

    request_omega_msr / _esr, requests_total    TP rank 0 of the last stage, once per request
    router_latency_seconds                      each TP rank of the last stage: its router time summed over stages
    head_decisions_total{layer}                 the stage holding the layer; a KV head by its first TP replica
    live_requests                               the TP ranks of the last stage (every stage holds the same requests)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from elastic_vllm.config import ConfigError
from elastic_vllm.vllm_plugin import compat

logger = logging.getLogger("elastic_vllm.vllm_plugin")

# gloo tag of our stage-to-stage messages ("EL"); vLLM's own pipeline messages use the default tag 0
PP_TAG = 0x454C


def global_kv_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> list[int]:
    """Global index of each KV head this rank holds (vLLM's QKVParallelLinear sharding):
    local head j -> shard_rank * num_local + j, shard_rank = tp_rank // replicas; when
    tp_size > total_kv_heads every head is replicated on tp_size // total_kv_heads ranks."""
    replicas = max(1, tp_size // total_kv_heads)
    num_local = max(1, total_kv_heads // tp_size)
    shard = tp_rank // replicas
    return [shard * num_local + j for j in range(num_local)]


def is_first_replica(tp_rank: int, tp_size: int, total_kv_heads: int) -> bool:
    """True on the first of the ranks holding the same KV heads (every rank when none is replicated):
    the rank that counts those heads in per-head metrics."""
    return tp_rank % max(1, tp_size // total_kv_heads) == 0


@dataclass(frozen=True)
class HeadCounts:
    """One request's final routing on one rank, reduced to what the Omegas over all ranks need."""

    kv_heads: tuple[int, ...]  # global KV heads of the rank (replicas hold the same tuple)
    heads: int  # (layer, KV head) pairs: layers of the stage * len(kv_heads)
    fa: int  # of them routed to FA
    esr_sum: float  # sum over them of the pruned share of causal pairs (Omega_ESR * heads)
    stage: int = 0  # pipeline stage: ranks of different stages hold different layers, never replicas


def global_omegas(per_rank: list[dict[str, HeadCounts]]) -> dict[str, tuple[float, float]]:
    """(Omega_MSR, Omega_ESR) of each request over every (layer, global KV head) counted once, from the
    HeadCounts each rank reported (``per_rank[r]``: req_id -> counts of rank r). Ranks of one stage that
    hold the same KV heads (replicas, tp_size > num_kv_heads) count once: the first one reporting them."""
    out: dict[str, tuple[float, float]] = {}
    for rid in dict.fromkeys(rid for counts in per_rank for rid in counts):
        seen: set[tuple[int, tuple[int, ...]]] = set()
        heads = fa = 0
        esr = 0.0
        for counts in per_rank:
            c = counts.get(rid)
            if c is None or (c.stage, c.kv_heads) in seen:
                continue
            seen.add((c.stage, c.kv_heads))
            heads, fa, esr = heads + c.heads, fa + c.fa, esr + c.esr_sum
        out[rid] = ((heads - fa) / heads, esr / heads)
    return out


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: its TP rank, its pipeline stage and the layers [first, end) the stage holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layers: tuple[int, int] = (0, 0)

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def records_requests(self) -> bool:
        """The one rank of the engine recording per-request metrics."""
        return self.last_stage and self.tp_rank == 0

    def describe(self) -> str:
        return f"tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size} (layers {self.layers[0]}-{self.layers[1] - 1})"


def topology(num_layers: int) -> Topology:
    tp_rank, tp_size = compat.tp_rank_and_size()
    pp_rank, pp_size = compat.pp_rank_and_size()
    layers = compat.pp_stage_layers(num_layers, pp_rank, pp_size) if pp_size > 1 else (0, num_layers)
    return Topology(tp_rank, tp_size, pp_rank, pp_size, layers)


def check_stage_layers(topo: Topology, layer_names: list[str]) -> None:
    """The attention layers vLLM built on this stage are the ones :func:`topology` assigned it (a model that
    splits its layers otherwise would get its Omegas over the wrong layers): an error naming both."""
    got = sorted({compat.extract_layer_index(n) for n in layer_names})
    if got and (got[0] < topo.layers[0] or got[-1] >= topo.layers[1]):
        raise RuntimeError(
            f"elastic: pipeline stage {topo.pp_rank} holds attention layers {got[0]}-{got[-1]}, but vLLM's "
            f"get_pp_indices gives it {topo.layers[0]}-{topo.layers[1] - 1}; this model's layer split is not supported"
        )


def check_parallel_support(vllm_config) -> None:
    """A ConfigError naming the parallel mode the elastic backend does not support; TP, PP and DP are."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        return
    unsupported = {
        "expert parallelism (--enable-expert-parallel)": bool(getattr(pc, "enable_expert_parallel", False)),
        "decode context parallelism (--decode-context-parallel-size > 1)": getattr(
            pc, "decode_context_parallel_size", 1
        )
        > 1,
        "prefill context parallelism (--prefill-context-parallel-size > 1)": getattr(
            pc, "prefill_context_parallel_size", 1
        )
        > 1,
        "micro-batching (--enable-dbo / --ubatch-size > 1)": bool(getattr(pc, "enable_dbo", False))
        or getattr(pc, "ubatch_size", 0) > 1,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ConfigError(
            f"elastic: {', '.join(bad)} is not supported by the elastic attention backend: its routing tables and "
            "per-request metrics assume each rank sees whole requests with every KV block of its heads. Supported: "
            "--tensor-parallel-size, --pipeline-parallel-size, --data-parallel-size"
        )


def warn_if_metrics_stay_here(vllm_config) -> None:
    """A worker started by Ray inherits PROMETHEUS_MULTIPROC_DIR only when vLLM copies it (it copies VLLM_*,
    HF_*, ... and the names in VLLM_RAY_EXTRA_ENV_VARS_TO_COPY): without it the routing metrics this worker
    records stay in its memory and no /metrics shows them. Warn, naming the fix (offline use may not care)."""
    pc = getattr(vllm_config, "parallel_config", None)
    ray = "ray" in (str(getattr(pc, "distributed_executor_backend", "")), str(getattr(pc, "data_parallel_backend", "")))
    if ray and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning(
            "elastic: this Ray worker has no PROMETHEUS_MULTIPROC_DIR, so the elastic: routing metrics it records "
            "reach no /metrics; set PROMETHEUS_MULTIPROC_DIR to a fresh folder that exists on every node and "
            "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PROMETHEUS_MULTIPROC_DIR before `vllm serve` (docs/scaling.md)"
        )


def _encode(counts: dict[str, HeadCounts], router_s: float) -> bytes:
    """A stage's message to the last stage: JSON (the package never unpickles what a peer sends)."""
    rows = {rid: [list(c.kv_heads), c.heads, c.fa, c.esr_sum, c.stage] for rid, c in counts.items()}
    return json.dumps({"counts": rows, "router_s": router_s}).encode()


def _decode(data: bytes) -> tuple[dict[str, HeadCounts], float]:
    msg = json.loads(data)
    counts = {
        rid: HeadCounts(tuple(kv), heads, fa, esr, stage) for rid, (kv, heads, fa, esr, stage) in msg["counts"].items()
    }
    return counts, float(msg["router_s"])


class OmegaExchange:
    """Assembles each request's Omegas over every layer and KV head from the counts of every rank."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._sends: list[Any] = []  # works and buffers of messages not yet known delivered

    def omegas(self, local: dict[str, HeadCounts], router_s: float) -> tuple[dict[str, tuple[float, float]], float]:
        """(req_id -> (Omega_MSR, Omega_ESR) over the whole model, router time summed over stages). Empty at
        TP = PP = 1 (``local`` is the whole model); NaN Omegas on stages other than the last, which send their
        counts on and never learn the totals. Every rank calls it on the same steps (see the module docstring)."""
        t = self.topo
        if t.pp_size > 1 and not t.last_stage:
            self._reap()
            self._sends.append(compat.pp_isend_bytes(_encode(local, router_s), t.pp_size - 1, PP_TAG))
            return {rid: (float("nan"), float("nan")) for rid in local}, router_s
        mine = [local]
        for stage in range(t.pp_size - 1):
            counts, s = _decode(compat.pp_recv_bytes(stage, PP_TAG))
            if set(counts) != set(local):
                logger.error(
                    "elastic: pipeline stage %d finalized the routing of %s on the step where the last stage "
                    "finalized %s; the stages' schedules disagree",
                    stage,
                    sorted(counts),
                    sorted(local),
                )
            mine.append(counts)
            router_s += s
        if t.tp_size == 1 and t.pp_size == 1:
            return {}, router_s
        per_rank = [c for rank in compat.tp_all_gather_object(mine) for c in rank] if t.tp_size > 1 else mine
        missing = [rid for rid in local if any(rid not in counts for counts in per_rank)]
        if missing:  # would mean ranks disagree on the schedule; record what this rank has
            logger.error("elastic: ranks did not all finalize the routing of %s on the same step", missing)
        return {rid: v for rid, v in global_omegas(per_rank).items() if rid not in missing}, router_s

    def _reap(self) -> None:
        self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[0])]
