"""The requests one engine holds routing state for, and their routing-table slots.

Lifecycle, from each step's SchedulerOutput: a new request gets a :class:`RequestState` (prompt length, its
override and knobs, the bias the load policy gave it); ``finished_req_ids`` (done or aborted) frees it; a preempted /
resumed request keeps its state but loses its final routing, which is recomputed when it reaches the end of its prompt
again. Slots: with vLLM's own request index (V2 runner, 0.32+) the slot is vLLM's; otherwise :meth:`Requests.slot`
allocates one, freed with the request. Slot ``num_slots - 1`` is reserved and stays all-FA (dummy and padding rows
read it).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from elastic_vllm.config import ElasticConfig
from elastic_vllm.vllm_plugin import observe
from elastic_vllm.vllm_plugin.overrides import (
    LOAD_BIAS_KEY,
    Knobs,
    check_allowed,
    effective_force,
    engine_load_bias,
    request_knobs,
    request_override,
)

logger = logging.getLogger("elastic_vllm.vllm_plugin")

# Request ids vLLM 0.26's model runner V2 gives the requests of its kernel warm-up, which it runs through
# execute_model like scheduled requests (vllm/v1/worker/gpu/warmup.py: warmup_kernels, min(max_num_seqs, ...)
# requests of 2 tokens; run_mixed_prefill_decode_warmup). They are routed like any request (the warm-up must
# compile what real requests run) but are no requests of a client: recording them put max_num_seqs phantom
# Omega observations on /metrics (the TP=2 H200 check: 12 observations for 4 requests, the 8 extra summing to
# exactly 4.0).
VLLM_WARMUP_REQ_ID = re.compile(r"_warmup_\d+_|_v2_mixed_warmup_(?:decode|prefill)_")


def is_vllm_warmup_request(req_id: str) -> bool:
    return VLLM_WARMUP_REQ_ID.fullmatch(req_id) is not None


@dataclass
class RequestState:
    req_id: str
    prompt_len: int
    override: str  # the request's own elastic_force
    force: str  # effective: override, or the server's force when override is auto
    knobs: Knobs = field(default_factory=Knobs)  # its own elastic_bias / elastic_target_omega (recorded as requested)
    bias: float = 0.0  # what its routing applies: its own bias, else the server's bias plus the load bias
    target: float | None = None  # its own target, else the server's target_omega (when it sent no bias)
    load_bias: float = 0.0  # the bias level the engine core's load policy gave it at admission
    slot: int | None = None  # our allocator's slot (None with vLLM's req_idx)
    table_slot: int | None = None  # where its final routing sits in the table
    final: bool = False
    recorded: bool = False
    pending: bool = False  # final this step: record at step end
    router_time: float = 0.0
    first_decisions: torch.Tensor | None = None
    xa_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, head) -> [nb, nb]
    warmup: bool = False  # one of vLLM's own warm-up requests: routed, never recorded


class Requests:
    """req_id -> :class:`RequestState` of the live requests, the slot allocator, and this step's token counts."""

    def __init__(self, cfg: ElasticConfig) -> None:
        self.cfg = cfg
        self.by_id: dict[str, RequestState] = {}
        self.free_slots: list[int] = []
        self.num_slots = 0
        self.step_tokens: dict[str, int] = {}  # tokens scheduled this step, per request
        self.step_computed: dict[str, int] = {}  # tokens already in the cache at the step's start

    def size_slots(self, num_slots: int) -> None:
        """``num_slots`` table rows, the last one reserved (all FA)."""
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 2, -1, -1))

    # --- the dict of live requests ----------------------------------------------------------------
    def __contains__(self, rid: object) -> bool:
        return rid in self.by_id

    def __getitem__(self, rid: str) -> RequestState:
        return self.by_id[rid]

    def __iter__(self):
        return iter(self.by_id)

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, rid: str) -> RequestState | None:
        return self.by_id.get(rid)

    def values(self):
        return self.by_id.values()

    # --- lifecycle --------------------------------------------------------------------------------
    def begin_step(self, so) -> None:
        """Apply a SchedulerOutput: free finished requests, re-admit preempted / resumed ones, add new ones, and
        take the step's scheduled and computed token counts."""
        for rid in so.finished_req_ids:  # finished or aborted: free
            self.free(rid)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self.readmit(rid)
        for nr in so.scheduled_new_reqs:
            if nr.req_id in self.by_id:  # V2 re-adds preempted requests as new ones
                self.readmit(nr.req_id)
            else:
                self.add(nr)
            self.step_computed[nr.req_id] = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid in getattr(cached, "resumed_req_ids", None) or ():
            self.readmit(rid)
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            self.step_computed[rid] = n
        self.step_tokens = dict(so.num_scheduled_tokens)

    def end_step(self) -> None:
        self.step_tokens = {}
        self.step_computed = {}

    def needs_eager_attention(self) -> bool:
        """A row of this step may be routed: attention (which routes) must run eagerly, not in a FULL CUDA graph
        (e.g. a chunk of one token, or the last prompt token of a full prefix hit)."""
        return any(rid in self.by_id and not self.by_id[rid].final for rid in self.step_tokens)

    def add(self, nr) -> None:
        if nr.prompt_token_ids is not None:
            prompt_len = len(nr.prompt_token_ids)
        elif getattr(nr, "prompt_embeds", None) is not None:
            prompt_len = int(nr.prompt_embeds.shape[0])
        else:
            raise RuntimeError(f"elastic: request {nr.req_id} has neither prompt token ids nor embeddings")
        extra = getattr(nr.sampling_params, "extra_args", None) if nr.sampling_params is not None else None
        client = {k: v for k, v in extra.items() if k != LOAD_BIAS_KEY} if extra else extra
        cfg = self.cfg
        try:
            override = request_override(client)
            knobs = request_knobs(client)
            check_allowed(override, cfg, knobs)
            load_bias = engine_load_bias(extra, cfg.load_policy.max_bias)
        except ValueError as e:  # admission validates this; never take the engine down for it
            logger.error("elastic: request %s: %s; using the server default", nr.req_id, e)
            observe.COUNTERS.invalid_overrides += 1
            override, knobs, load_bias = "auto", Knobs(), 0.0
        if knobs.key is not None:  # its own knob replaces the server's bias / target and the load policy
            bias, target = knobs.bias or 0.0, knobs.target
        else:
            bias, target = cfg.bias + load_bias, cfg.target_omega
        self.by_id[nr.req_id] = RequestState(
            req_id=nr.req_id,
            prompt_len=prompt_len,
            override=override,
            force=effective_force(override, cfg.force),
            knobs=knobs,
            bias=bias,
            target=target,
            load_bias=load_bias,
            warmup=is_vllm_warmup_request(nr.req_id),
        )

    def readmit(self, rid: str) -> None:
        st = self.by_id.get(rid)
        if st is not None and st.final:
            st.final = False
            st.xa_rows.clear()

    def free(self, rid: str) -> None:
        st = self.by_id.pop(rid, None)
        if st is not None and st.slot is not None:
            self.free_slots.append(st.slot)

    def slot(self, st: RequestState) -> int:
        if st.slot is None:
            if not self.free_slots:
                raise RuntimeError(f"elastic: no free routing slot for {st.req_id} ({self.num_slots - 1} slots)")
            st.slot = self.free_slots.pop()
        return st.slot
