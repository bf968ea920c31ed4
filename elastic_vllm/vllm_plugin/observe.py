"""Observability seam of the vLLM backend.

:func:`on_routing_final` is called exactly once per request, in the worker process of each tensor-
and pipeline-parallel rank, when the request's routing is final (the step whose prefill chunk completes the
prompt; see ``state.py``). It keeps the event in a bounded in-process registry (tests read it) and
hands it to the Prometheus metrics of ``elastic_vllm.telemetry``.

:data:`COUNTERS` proves the elastic path ran: forward calls, rows routed, routings made final,
re-routings after preemption and their mismatches. The step-level deltas are also published as the
Prometheus counters ``elastic:attention_forward_calls_total``, ``elastic:routed_rows_total`` and
``elastic:router_nonfinite_heads_total`` (visible on the API server's /metrics in prometheus_client
multiprocess mode).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("elastic_vllm.vllm_plugin")

REGISTRY_SIZE = 4096


@dataclass(frozen=True)
class RoutingEvent:
    """The final routing of one request on one rank (host tensors). ``decisions`` .. ``omega_esr`` cover this
    rank's KV heads of its pipeline stage's layers (``first_layer`` is the global index of row 0); ``omega_*_all``
    every layer and KV head of the model (what the metrics record; NaN on stages other than the last)."""

    req_id: str
    model_name: str
    tp_rank: int
    kv_heads: tuple[int, ...]  # global KV-head index of each column (tensor parallelism)
    decisions: torch.Tensor  # bool [L, Hkv_local], True = FA (router index 1)
    head_modes: torch.Tensor  # int8 [L, Hkv_local], HeadMode of prefill queries
    logits: torch.Tensor  # float32 [L, Hkv_local, 2]; zeros where the router did not run (forced)
    prompt_len: int
    omega_msr: float
    omega_esr: float
    omega_msr_all: float  # over every layer and KV head of the model, each once (ranks exchange head counts)
    omega_esr_all: float
    router_latency_s: float  # on the last pipeline stage: summed over the stages
    override: str  # the request's own elastic_force ("auto" when absent)
    force: str  # what it ran with: its override, the server's force, "bias", "target-omega", "load-bias"
    pooled: torch.Tensor | None = None  # float32 [L, Hkv_local, D] when ELASTIC_VLLM_RECORD_POOLED=1
    counts_heads: bool = True  # False on a rank replicating KV heads another rank counts in the metrics
    first_layer: int = 0  # pipeline parallelism: global index of the stage's first layer
    pp_rank: int = 0
    last_stage: bool = True  # records the per-request metrics (its TP rank 0) and the router time
    requested_bias: float | None = None  # the request's own elastic_bias
    requested_target_omega: float | None = None  # the request's own elastic_target_omega
    bias: float = 0.0  # the bias its routing applied (its own, else the server's plus the load policy's)
    target_omega: float | None = None  # the fixed budget its routing applied (its own, else the server's)


@dataclass
class Counters:
    forward_calls: int = 0  # ElasticAttentionImpl.forward calls with metadata (one per layer and step)
    routed_rows: int = 0  # (row, step) pairs the router ran for (final and prefix routings)
    final_routings: int = 0  # requests whose routing became final (== on_routing_final calls)
    rerouted: int = 0  # routings recomputed after preemption
    warmup_routings: int = 0  # vLLM's own warmup requests (V2 runner): routed, not recorded as requests
    reroute_mismatches: int = 0  # ... that differed from the first decision
    invalid_overrides: int = 0  # unknown elastic_force values that reached the worker
    mixed_steps: int = 0  # steps whose batch mixed rows with a final routing (decodes) and rows routed now
    fused_route_layers: int = 0  # (layer, step) routings whose tables the router kernel wrote itself
    dense_steps: int = 0  # steps whose every head was full attention, run by vLLM's FlashAttention kernel
    fa_split_steps: int = 0  # hybrid prompt steps whose FA heads ran on vLLM's FlashAttention kernel
    nonfinite_router_heads: int = 0  # (request, layer, KV head) final decisions run FA for NaN / inf logits
    _published: dict[str, int] = field(default_factory=dict, repr=False)

    def snapshot(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


COUNTERS = Counters()
_events: deque[RoutingEvent] = deque(maxlen=REGISTRY_SIZE)
_lock = threading.Lock()
_prom: dict[str, object] = {}


def on_routing_final(event: RoutingEvent) -> None:
    """The seam: one call per request when its routing is final."""
    with _lock:
        _events.append(event)
        COUNTERS.final_routings += 1
    try:
        from elastic_vllm.telemetry.metrics import RoutingRecord, record_routing

        record_routing(
            RoutingRecord(
                req_id=event.req_id,
                model_name=event.model_name,
                decisions=event.decisions,
                omega_msr=event.omega_msr_all,
                omega_esr=event.omega_esr_all,
                prompt_len=event.prompt_len,
                router_latency_s=event.router_latency_s,
                override=event.force,
                tp_rank=event.tp_rank,
                count_heads=event.counts_heads,
                first_layer=event.first_layer,
                pp_last=event.last_stage,
                requested_bias=event.requested_bias,
                requested_target_omega=event.requested_target_omega,
            )
        )
    except Exception:  # metrics must never take the engine down
        logger.exception("elastic-vllm: recording routing metrics failed")


def events(req_id: str | None = None) -> list[RoutingEvent]:
    with _lock:
        return [e for e in _events if req_id is None or e.req_id == req_id]


def rpc_events(_worker=None) -> list[dict]:
    """This process's routing events as plain data, for ``LLM.collective_rpc(rpc_events)`` (one list per
    worker: with tensor parallelism, each rank's events cover its own KV heads)."""
    return [
        {
            "req_id": e.req_id,
            "tp_rank": e.tp_rank,
            "pp_rank": e.pp_rank,
            "first_layer": e.first_layer,
            "kv_heads": list(e.kv_heads),
            "decisions": e.decisions.tolist(),
            "logits": e.logits.tolist(),
            "omega_msr": e.omega_msr,  # this rank's heads
            "omega_esr": e.omega_esr,
            "omega_msr_all": e.omega_msr_all,  # every layer and head of the model, once (what /metrics records)
            "omega_esr_all": e.omega_esr_all,
            "counts_heads": e.counts_heads,
            "prompt_len": e.prompt_len,
            "router_latency_s": e.router_latency_s,
        }
        for e in events()
    ]


def clear() -> None:
    with _lock:
        _events.clear()


# Counters published every step: COUNTERS field -> (Prometheus name, without the _total suffix; help text)
STEP_METRICS = {
    "forward_calls": ("elastic:attention_forward_calls", "Elastic attention forward calls (one per layer and step)."),
    "routed_rows": (
        "elastic:routed_rows",
        "Request rows the elastic router ran for (final and prefix-chunk routings).",
    ),
    "dense_steps": ("elastic:dense_steps", "Steps whose every head was full attention, run by vLLM's FlashAttention."),
    "fa_split_steps": (
        "elastic:fa_split_steps",
        "Hybrid prompt steps whose FA heads ran on vLLM's FlashAttention (the other heads on the elastic kernel).",
    ),
    "nonfinite_router_heads": (
        "elastic:router_nonfinite_heads",
        "KV-head decisions that ran FA because their router logits were NaN / inf (not those a budget sent to SA).",
    ),
}


def publish_counters() -> None:
    """Push the counter deltas since the last call to Prometheus (once per step)."""
    try:
        from prometheus_client import Counter
    except ImportError:  # pragma: no cover - a declared dependency
        return
    for name, (metric_name, doc) in STEP_METRICS.items():
        value = getattr(COUNTERS, name)
        delta = value - COUNTERS._published.get(name, 0)
        if delta <= 0:
            continue
        metric = _prom.get(name)
        if metric is None:
            metric = _prom[name] = Counter(metric_name, doc)
        metric.inc(delta)  # type: ignore[attr-defined]
        COUNTERS._published[name] = value
