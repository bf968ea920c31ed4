"""Recording of final routings: once per request, off the step's critical path.

A request's routing becomes final in the step whose prefill reaches the end of its prompt. At the end of
that step's ``execute_model`` the forward has only been launched; reading the routing table back then
(``.cpu()``) would block the host until the GPU finished the step, and under vLLM's async scheduling the
next step's scheduling and input preparation would no longer overlap the GPU. So the step end only
*snapshots* the table rows of the requests made final (a device gather and a non-blocking copy into
pinned host memory, then a CUDA event); the snapshot is recorded when the step's output is read
(``AsyncModelRunnerOutput.get_output``: the forward is done by then, so nothing waits), or at the latest
at the next step's end. On the CPU every copy is complete when it returns; the same queue runs.

With tensor or pipeline parallelism the ranks exchange per-request head counts (``parallel.OmegaExchange``)
in messages that must run in the same order on every rank, on the thread that runs the steps: there the
snapshot is recorded at the step end (the exchange waits for the copy anyway).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.sparsity import omega_esr, omega_msr
from elastic_vllm.vllm_plugin import observe
from elastic_vllm.vllm_plugin.overrides import routing_mode
from elastic_vllm.vllm_plugin.parallel import HeadCounts, OmegaExchange, Topology

if TYPE_CHECKING:
    from elastic_vllm.vllm_plugin.requests import RequestState

logger = logging.getLogger("elastic_vllm.vllm_plugin")


class StepTimer:
    """Router time of one step: host clock on the CPU, CUDA events on the GPU. The events are read only
    once the step's snapshot is complete (they precede it on the stream), so reading never waits."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = 0.0
        self.events: list[tuple[Any, Any]] = []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, t0) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((t0, e))
        else:
            self.host += time.perf_counter() - t0

    def seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()  # the last one recorded: every earlier event is complete
            self.host += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
            self.events.clear()
        return self.host


@dataclass
class Snapshot:
    """The table rows of the requests whose routing became final in one step (host tensors, possibly
    still being copied until ``ready`` completes)."""

    states: list[RequestState]
    fa: torch.Tensor  # bool [P, L, Hkv]
    modes: torch.Tensor  # int8 [P, L, Hkv]
    logits: torch.Tensor  # float32 [P, L, Hkv, 2]
    pooled: torch.Tensor | None  # float32 [P, L, Hkv, D]
    ready: Any  # torch.cuda.Event recorded after the copies, or None (complete)
    timer: StepTimer
    step: int  # the engine step that made these routings final


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class Recorder:
    """FIFO of snapshots, recorded in step order (a re-routing after preemption is compared with the
    first routing of its request, which an earlier snapshot recorded)."""

    def __init__(
        self,
        cfg: ElasticConfig,
        model_name: str,
        topo: Topology,
        kv_heads: tuple[int, ...],
        first_replica: bool,
        router_path: str | None,
    ) -> None:
        self.cfg = cfg
        self.model_name = model_name
        self.topo = topo
        self.tp_rank = topo.tp_rank
        self.exchange = OmegaExchange(topo)
        self.sync = topo.tp_size > 1 or topo.pp_size > 1  # the exchange runs on the step thread, in step order
        self.kv_heads = kv_heads
        self.first_replica = first_replica
        self.router_path = router_path
        self.queue: deque[Snapshot] = deque()
        # the output thread of vLLM's multiprocess executor may drain while the step thread snapshots
        self.lock = threading.Lock()
        self._warned_nonfinite = False

    def snapshot(self, states: list[RequestState], tables: tuple, timer: StepTimer, step: int) -> None:
        """Queue the final routings of ``states`` (their ``table_slot`` rows of ``tables`` = (fa, modes,
        logits, pooled or None), this pipeline stage's layers); with tensor / pipeline parallelism, record
        them now."""
        fa, modes, logits, pooled = tables
        slots = torch.tensor([st.table_slot for st in states], dtype=torch.long).to(fa.device, non_blocking=True)
        lo, hi = self.topo.layers  # every layer without pipeline parallelism

        def rows(t: torch.Tensor) -> torch.Tensor:
            return _to_host(t.index_select(0, slots)[:, lo:hi])

        snap = Snapshot(
            states=states,
            fa=rows(fa),
            modes=rows(modes),
            logits=rows(logits),
            pooled=rows(pooled) if pooled is not None else None,
            ready=None,
            timer=timer,
            step=step,
        )
        if fa.device.type == "cuda":
            snap.ready = torch.cuda.Event()
            snap.ready.record()
        with self.lock:
            self.queue.append(snap)
        if self.sync:
            self.drain()

    def drain(self, upto: int | None = None) -> None:
        """Record the queued snapshots of steps <= ``upto`` (all when None), waiting for their copies.
        A step's output must not wait for a later step's forward: the hook reading step N's output drains
        up to N only, although the next step may already have queued its snapshot."""
        with self.lock:
            while self.queue and (upto is None or self.queue[0].step <= upto):
                snap = self.queue.popleft()
                if snap.ready is not None:
                    snap.ready.synchronize()
                self._record(snap)

    def _record(self, snap: Snapshot) -> None:
        latency = snap.timer.seconds()  # the step's router time, shared by the rows routed in it
        fa, modes, logits, pooled = snap.fa, snap.modes, snap.logits, snap.pooled
        self._count_nonfinite(snap.states, logits, fa)
        fresh: list[tuple[int, RequestState, float]] = []  # (index, state, local Omega_ESR)
        for i, st in enumerate(snap.states):
            st.router_time = latency
            if st.recorded:  # re-routed after preemption: same keys, same decision expected
                observe.COUNTERS.rerouted += 1
                if not torch.equal(fa[i], st.first_decisions):
                    observe.COUNTERS.reroute_mismatches += 1
                    logger.warning(
                        "elastic: request %s re-routed after preemption with a different decision", st.req_id
                    )
                continue
            st.recorded = True
            st.first_decisions = fa[i]
            if st.warmup:  # every TP rank sees the same warm-up requests: the gather below stays aligned
                observe.COUNTERS.warmup_routings += 1
                continue
            fresh.append((i, st, self._esr(st, modes[i])))
            st.xa_rows.clear()
        if not fresh:
            return
        omegas, latency = self.exchange.omegas(
            {
                st.req_id: HeadCounts(
                    self.kv_heads, fa[i].numel(), int(fa[i].sum()), esr * fa[i].numel(), self.topo.pp_rank
                )
                for i, st, esr in fresh
            },
            latency,
        )
        for i, st, esr in fresh:
            msr = omega_msr(fa[i])
            all_msr, all_esr = omegas.get(st.req_id, (msr, esr))
            observe.on_routing_final(
                observe.RoutingEvent(
                    req_id=st.req_id,
                    model_name=self.model_name,
                    tp_rank=self.tp_rank,
                    kv_heads=self.kv_heads,
                    decisions=fa[i],
                    head_modes=modes[i],
                    logits=logits[i],
                    prompt_len=st.prompt_len,
                    omega_msr=msr,
                    omega_esr=esr,
                    omega_msr_all=all_msr,
                    omega_esr_all=all_esr,
                    router_latency_s=latency,
                    override=st.override,
                    force=routing_mode(st.override, self.cfg.force, st.knobs, st.load_bias),
                    requested_bias=st.knobs.bias,
                    requested_target_omega=st.knobs.target,
                    bias=st.bias,
                    target_omega=st.target,
                    pooled=pooled[i] if pooled is not None else None,
                    counts_heads=self.first_replica,
                    first_layer=self.topo.layers[0],
                    pp_rank=self.topo.pp_rank,
                    last_stage=self.topo.last_stage,
                )
            )

    def _count_nonfinite(self, states: list[RequestState], logits: torch.Tensor, fa: torch.Tensor) -> None:
        """Heads that ran FA because their router logits were NaN / inf (``router.model.decide``): count them, and
        warn the first time (a router that overflows, or NaN keys in the cache). Only those: a budget
        (``decide_budget``) may still send such a head to SA, and a forced request's heads never follow its router.
        logits [P, L, H, 2], fa [P, L, H] (final decisions)."""
        routed = torch.tensor([st.force == "auto" for st in states], dtype=torch.bool).view(-1, 1, 1)
        bad = (~torch.isfinite(logits)).any(-1) & fa.bool() & routed  # [P, L, H]
        n = int(bad.sum())
        if not n:
            return
        observe.COUNTERS.nonfinite_router_heads += n
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            rid = states[int(bad.flatten(1).any(1).nonzero()[0])].req_id
            logger.warning(
                "elastic: router %s gave NaN / inf logits for %d KV-head decisions (request %s); those heads "
                "run FA. Counted in elastic:router_nonfinite_heads_total; this warning is not repeated",
                self.router_path,
                n,
                rid,
            )

    def _esr(self, st: RequestState, modes: torch.Tensor) -> float:
        """Omega_ESR of the final head modes at the prompt length (``elastic_vllm.sparsity``). XA heads
        use the blocks their prefill selected (torch path); query blocks without a recorded selection
        (earlier chunks in another mode, prefix-cache hits, and every block on the Triton path, whose
        selection stays on the device) count as dense, so Omega_ESR is a lower bound there."""
        masks = None
        if (modes == HeadMode.XA).any():
            blk = self.cfg.xattn_block
            nb = (st.prompt_len + blk - 1) // blk
            dense = torch.ones(nb, nb, dtype=torch.bool).tril()
            masks = {}
            for layer, h in (modes == HeadMode.XA).nonzero().tolist():
                sel = st.xa_rows.get((layer + self.topo.layers[0], h))  # xa_rows: global layer index
                if sel is None:
                    masks[(layer, h)] = dense
                else:
                    rows_sel = sel.any(dim=1, keepdim=True)
                    masks[(layer, h)] = torch.where(rows_sel, sel, dense)
        return omega_esr(modes, st.prompt_len, self.cfg, masks)
