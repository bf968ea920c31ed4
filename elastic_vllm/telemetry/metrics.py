"""Prometheus metrics of Elastic Attention routing, recorded once per request when its routing is final.

| metric                               | type      | labels                             |
|--------------------------------------|-----------|------------------------------------|
| elastic:request_omega_msr            | histogram | model_name                         |
| elastic:request_omega_esr            | histogram | model_name                         |
| elastic:head_decisions_total         | counter   | model_name, layer, decision, tp_rank |
| elastic:router_latency_seconds       | histogram | model_name, tp_rank                |
| elastic:requests_total               | counter   | model_name, override               |
| elastic:live_requests                | gauge     | model_name, tp_rank                |
| elastic:requested_bias               | histogram | model_name                         |
| elastic:requested_target_omega       | histogram | model_name                         |
| elastic:load_bias                    | gauge     | model_name                         |

- Omega_MSR: share of KV heads (all layers, all TP ranks) routed to SA; Omega_ESR: mean pruned share
  of the causal (query, key) pairs at the request's prompt length (``elastic_vllm.sparsity``).
- With tensor parallelism each rank routes its own KV heads, with pipeline parallelism each stage its
  own layers: the per-request Omegas are assembled on the last stage (``vllm_plugin/parallel.py``) so
  that they cover every layer and KV head once, and recorded by its TP rank 0;
  ``head_decisions_total`` is counted by the rank holding each (layer, head) (by the first of its
  replicas when tp_size > num_kv_heads); ``router_latency_seconds`` by the last stage's ranks (the
  request's router time summed over stages); ``live_requests`` by the last stage's ranks.
- With data parallelism each replica records its own requests; the multiprocess collector sums them.
- ``head_decisions_total{decision="FA"|"SA"}`` counts every (layer, KV head) decision once, so
  ``sum(rate(..{decision="SA"}[5m])) / sum(rate(..[5m]))`` is the fleet-wide sparsity and
  ``sum by (layer)`` the per-layer SA share.
- ``override`` is the mode the request ran with: auto, all-FA, all-SA (its own elastic_force, else the
  server's force), bias / target-omega (its own elastic_bias / elastic_target_omega) or load-bias (the load
  policy raised its bias).
- ``requested_bias`` / ``requested_target_omega``: the values requests sent (those that sent one), recorded with
  ``requests_total``; ``load_bias``: the load policy's bias level now (engine core; 0 when idle or off).
- ``live_requests``: requests holding per-request routing state in the engine (``state.py``); 0 when idle.

The metrics are written by the engine process. They reach the API server's /metrics only in
prometheus_client's multiprocess mode: PROMETHEUS_MULTIPROC_DIR must be set, fresh, before any
process imports prometheus_client — ``elastic-vllm serve`` does it (see ``elastic_vllm/supervisor.py``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

MSR_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))  # 0.05 .. 1.0
# elastic_bias in router logits, [-1024, 1024]: symmetric, log-spaced (the shipped SmolLM2 router's margins
# |z_FA - z_SA| have a median of ~57 logits and a 10% quantile of 5-20 on the demo prompts, so biases that matter
# there lie between 4 and 256)
BIAS_BUCKETS = (-256.0, -64.0, -16.0, -4.0, -1.0, -0.25, 0.0, 0.25, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0)
LATENCY_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


@dataclass
class RoutingRecord:
    """One request's final routing (all layers, the KV heads this rank holds or, after a TP
    gather, all of them)."""

    req_id: str
    model_name: str
    decisions: torch.Tensor  # bool [L, Hkv], True = FA
    omega_msr: float
    omega_esr: float
    prompt_len: int
    router_latency_s: float
    override: str = "auto"
    tp_rank: int = 0
    count_heads: bool = True  # False on a rank replicating KV heads that another rank counts
    first_layer: int = 0  # global index of decisions' row 0 (pipeline parallelism: the stage's first layer)
    pp_last: bool = True  # on the last pipeline stage: records the router time and (TP rank 0) the request
    requested_bias: float | None = None  # the request's own elastic_bias
    requested_target_omega: float | None = None  # the request's own elastic_target_omega


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.msr = Histogram(
            "elastic:request_omega_msr",
            "Per-request Omega_MSR: share of KV heads routed to sparse attention.",
            ["model_name"],
            buckets=MSR_BUCKETS,
        )
        self.esr = Histogram(
            "elastic:request_omega_esr",
            "Per-request Omega_ESR: mean pruned share of causal attention pairs at the prompt length.",
            ["model_name"],
            buckets=MSR_BUCKETS,
        )
        self.decisions = Counter(
            "elastic:head_decisions",
            "KV-head routing decisions (one per layer and KV head per request).",
            ["model_name", "layer", "decision", "tp_rank"],
        )
        self.latency = Histogram(
            "elastic:router_latency_seconds",
            "Router time per request (all layers, this rank).",
            ["model_name", "tp_rank"],
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "elastic:requests",
            "Requests whose routing became final, by override mode.",
            ["model_name", "override"],
        )
        self.live = Gauge(
            "elastic:live_requests",
            "Requests holding per-request routing state in the engine (this rank); 0 when idle.",
            ["model_name", "tp_rank"],
            multiprocess_mode="livesum",
        )
        self.requested_bias = Histogram(
            "elastic:requested_bias",
            "elastic_bias sent by requests (router logits; > 0 sparser), those that sent one.",
            ["model_name"],
            buckets=BIAS_BUCKETS,
        )
        self.requested_target = Histogram(
            "elastic:requested_target_omega",
            "elastic_target_omega sent by requests (fixed share of SA heads), those that sent one.",
            ["model_name"],
            buckets=MSR_BUCKETS,
        )
        self.load_bias = Gauge(
            "elastic:load_bias",
            "Routing bias the load policy gives new requests now (router logits; 0 when idle or off).",
            ["model_name"],
            multiprocess_mode="mostrecent",
        )
        self._layer_children: dict[tuple[str, str, int], list[tuple]] = {}

    def decision_counters(self, model_name: str, rank: str, first_layer: int, layers: int) -> list[tuple]:
        """(FA, SA) children of ``head_decisions`` per layer, looked up once: ``labels()`` per layer and
        request (64 for 32 layers) took 190 of a recording's 440 us on a 2-core CPU. Layer labels are global
        (a pipeline stage holds layers ``first_layer ..``)."""
        key = (model_name, rank, first_layer)
        children = self._layer_children.get(key)
        if children is None or len(children) < layers:
            children = self._layer_children[key] = [
                (self.decisions.labels(model_name, str(layer), "FA", rank),
                 self.decisions.labels(model_name, str(layer), "SA", rank))
                for layer in range(first_layer, first_layer + layers)
            ]  # fmt: skip
        return children


_lock = threading.Lock()
_metrics: _Metrics | None = None


def metrics() -> _Metrics:
    """The process's metric objects, created on first use (never at import)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _Metrics()
        return _metrics


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def record_routing(rec: RoutingRecord) -> None:
    """Record one request's final routing. Call exactly once per request and rank: every rank counts
    its own KV heads of its stage's layers in head_decisions (but a replica of heads another rank
    counts: ``count_heads`` False); the last pipeline stage records the router time, and its TP rank 0
    the per-request metrics, whose Omegas must then cover every layer and KV head of the model
    (``parallel.global_omegas``)."""
    m = metrics()
    rank = str(rec.tp_rank)
    if rec.count_heads:
        dec = rec.decisions.bool().cpu()
        fa_per_layer = dec.sum(dim=1).tolist()
        heads = dec.shape[1]
        children = m.decision_counters(rec.model_name, rank, rec.first_layer, len(fa_per_layer))
        for (fa_counter, sa_counter), n_fa in zip(children, fa_per_layer):
            if n_fa:
                fa_counter.inc(n_fa)
            if heads - n_fa:
                sa_counter.inc(heads - n_fa)
    if not rec.pp_last:
        return  # an earlier pipeline stage: its router time and the request's Omegas reach the last stage
    m.latency.labels(rec.model_name, rank).observe(rec.router_latency_s)
    if rec.tp_rank == 0:
        m.msr.labels(rec.model_name).observe(rec.omega_msr)
        m.esr.labels(rec.model_name).observe(rec.omega_esr)
        m.requests.labels(rec.model_name, rec.override).inc()
        if rec.requested_bias is not None:
            m.requested_bias.labels(rec.model_name).observe(rec.requested_bias)
        if rec.requested_target_omega is not None:
            m.requested_target.labels(rec.model_name).observe(rec.requested_target_omega)


def set_live_requests(model_name: str, tp_rank: int, n: int) -> None:
    """The number of requests whose routing state the engine holds (updated by ``state.py``)."""
    metrics().live.labels(model_name, str(tp_rank)).set(n)


def set_load_bias(model_name: str, bias: float) -> None:
    """The load policy's current bias level (``vllm_plugin/load_policy.py``, engine core)."""
    metrics().load_bias.labels(model_name).set(bias)
