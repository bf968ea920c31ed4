"""Load-adaptive routing bias (``ElasticConfig.load_policy``, opt-in): sparser routing when the engine is behind.

The signal is one the engine core has every step: the prompt tokens still queued for prefill (waiting and
running requests), divided by ``max_num_batched_tokens``, i.e. how many scheduler steps of prefill work are ahead
(the backlog). Each step (``Scheduler.schedule``, hooked by :func:`install`)::

    ema  <- ema + w * (backlog - ema)                     w = load_policy.ema (smoothing over ~1/w steps)
    bias  = max_bias * clamp((ema - low) / (high - low), 0, 1), rounded DOWN to a multiple of max_bias / levels

so it rises as the backlog grows, falls as it drains, never exceeds ``max_bias`` and takes ``levels`` + 1 values.
An idle engine core (no unfinished request) has no backlog: the EMA restarts at 0 when a request arrives then,
because no step runs while idle to bring it down.

A new request gets the bias of the moment it reaches the engine core (``EngineCore.preprocess_add_request``,
before its prefix-cache block hashes exist): when it has no elastic knob of its own (``elastic_force``,
``elastic_bias``, ``elastic_target_omega``: requests that chose keep their choice) and the
bias is above 0, the bias goes into its ``extra_args`` (``elastic_load_bias``, which the worker adds to the
server's ``bias``) and its ``cache_salt`` (each level hashes its blocks apart, as every routing mode does; a few
levels keep prefix sharing). Its routing then applies that bias for good (routing runs once per request). The
level is published as the ``elastic:load_bias`` gauge (engine core process).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

from elastic_vllm.config import ElasticConfig
from elastic_vllm.config import LoadPolicy as LoadPolicyConfig
from elastic_vllm.vllm_plugin import compat
from elastic_vllm.vllm_plugin.overrides import (
    LOAD_BIAS_KEY,
    is_load_policy_eligible,
    load_bias_salt,
    salted,
    server_config,
)

logger = logging.getLogger("elastic_vllm.vllm_plugin")


def smooth(ema: float, backlog: float, weight: float) -> float:
    """One EMA step: the newest backlog weighs ``weight``."""
    return ema + weight * (backlog - ema)


def bias_level(ema: float, cfg: LoadPolicyConfig) -> float:
    """The bias for a smoothed backlog: 0 up to ``low``, ``max_bias`` from ``high``, linear between, rounded down
    to a multiple of ``max_bias / levels``. Monotone in ``ema`` and within [0, max_bias]."""
    frac = min(1.0, max(0.0, (ema - cfg.low) / (cfg.high - cfg.low)))
    # 1e-9: a backlog exactly on a level's edge (e.g. ema == high) is that level despite float rounding
    level = min(cfg.levels, math.floor(frac * cfg.levels + 1e-9))
    return cfg.max_bias * level / cfg.levels


class LoadPolicy:
    """The policy of one engine core (one per VllmConfig)."""

    def __init__(self, server_cfg: ElasticConfig, model_name: str, max_batched_tokens: int) -> None:
        self.server_cfg = server_cfg
        self.cfg: LoadPolicyConfig = server_cfg.load_policy
        self.model_name = model_name
        self.max_batched_tokens = max(1, int(max_batched_tokens))
        self.ema = 0.0
        self.bias = 0.0
        self.steps = 0
        self._publish()

    def observe(self, queued_prefill_tokens: int) -> float:
        """One scheduler step's backlog (prompt tokens still to prefill); returns the bias now."""
        self.steps += 1
        self.ema = smooth(self.ema, queued_prefill_tokens / self.max_batched_tokens, self.cfg.ema)
        bias = bias_level(self.ema, self.cfg)
        if bias != self.bias:
            self.bias = bias
            self._publish()
        return bias

    def on_idle(self) -> None:
        """No unfinished request in the engine core: no backlog (no step runs to decay the EMA while idle)."""
        if self.ema or self.bias:
            self.ema = 0.0
            self.bias = 0.0
            self._publish()

    def stamp(self, request: Any) -> float:
        """Give a new EngineCoreRequest the current bias (see the module docstring); returns what it got."""
        params = getattr(request, "sampling_params", None)
        bias = self.bias
        if params is None or bias <= 0.0:
            return 0.0
        extra = getattr(params, "extra_args", None)
        if not is_load_policy_eligible(extra, self.server_cfg):
            return 0.0
        params.extra_args = {**(extra or {}), LOAD_BIAS_KEY: bias}  # a new dict: never the caller's
        request.cache_salt = salted(getattr(request, "cache_salt", None), load_bias_salt(bias))
        return bias

    def _publish(self) -> None:
        self.publish(self.model_name, self.bias)

    @staticmethod
    def publish(model_name: str, bias: float) -> None:
        try:
            from elastic_vllm.telemetry.metrics import set_load_bias

            set_load_bias(model_name, bias)
        except Exception:  # metrics never take the engine down
            logger.exception("elastic-vllm: recording elastic:load_bias failed")


def queued_prefill_tokens(requests) -> int:
    """Prompt tokens not yet computed, over vLLM Requests (waiting and running). A walk over every request each
    step, linear in the requests the scheduler holds (two attribute reads each)."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests)


_POLICIES: dict[int, tuple[Any, LoadPolicy | None]] = {}


def for_config(vllm_config) -> LoadPolicy | None:
    """The load policy of an engine serving elastic (None when its ``load_policy`` is off or the configuration is
    invalid: the startup check refuses the latter)."""
    hit = _POLICIES.get(id(vllm_config))
    if hit is not None and hit[0]() is vllm_config:
        return hit[1]
    server = server_config(vllm_config)
    policy = None
    if server is not None and server[0].load_policy.enabled:
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        policy = LoadPolicy(server[0], compat.served_model_name(vllm_config), tokens)
        logger.info("elastic: load policy on: %s", server[0].load_policy.model_dump())
    elif server is not None:  # off: the gauge reads 0, so a dashboard panel shows the policy is not biasing
        LoadPolicy.publish(compat.served_model_name(vllm_config), 0.0)
    _POLICIES[id(vllm_config)] = (weakref.ref(vllm_config), policy)
    for key in [k for k, (ref, _) in _POLICIES.items() if ref() is None]:
        del _POLICIES[key]
    return policy


def install(class_path: str) -> None:
    """The load policy in the engine core (``compat.install_engine_core_hooks``): before every schedule it observes
    the prompt tokens queued for prefill (waiting, waiting with KV held, running); a request the engine core admits
    gets its bias, and the first one into an idle engine resets the policy first."""

    def on_schedule(vllm_config, scheduler) -> None:
        p = for_config(vllm_config)
        if p is not None:
            queues = (scheduler.waiting, getattr(scheduler, "kv_holding_waiting", ()), scheduler.running)
            p.observe(sum(queued_prefill_tokens(q) for q in queues))

    def on_add_request(vllm_config, engine_core, request) -> None:
        p = for_config(vllm_config)
        if p is not None:
            if engine_core.scheduler.get_num_unfinished_requests() == 0:
                p.on_idle()
            p.stamp(request)

    compat.install_engine_core_hooks(on_schedule, on_add_request, class_path)
