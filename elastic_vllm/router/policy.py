"""The routing policy: from a layer's router logits and a request's knobs to the mode of every KV head.

Written once, here; every routing path runs it or is tested against it: the vLLM backend's torch glue
(``vllm_plugin/routing.py``), the transformers integration (``hf/attention.py``) and the fused router
kernel's epilogue (``elastic_vllm/ops/route/kernel.py``, checked against :func:`route_heads` on a grid under the Triton
interpreter). For routed row r and KV head h of one layer, in this order::

    threshold  FA iff z_FA - z_SA > bias_r - sa_margin (float32; NaN / inf logits: FA)   decide
    floor      heads of the fa_floor mask: FA                                            floor
    budget     rows with a fixed SA budget: exactly n_r heads SA, the lowest margins,    decide_budget
               floor heads the last to go (replaces the threshold and the floor)
    force      all-FA -> every head FA, all-SA -> every head SA (explicit: over all of the above)
    modes      FA -> cfg.fa_mode, SA -> cfg.sa_mode (what the request's table keeps)
    phase      queries past the prompt: decode_mode dense -> FA, sparse -> SSA stays SSA, else FA

The tables these decisions go to (this step's modes per batch row, each request's final routing) are
:class:`RoutingTables`; :meth:`RoutingTables.write` is the torch glue's writer, and the kernel epilogue
writes the same tensors with the same rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from elastic_vllm.config import FA_FLOOR_DEFAULT, ConfigError, ElasticConfig, HeadMode
from elastic_vllm.router.model import decide, decide_budget

FORCE_CODE = {"auto": 0, "all-FA": 1, "all-SA": 2}


class HeadRouting(NamedTuple):
    """The routing of R rows at one layer."""

    fa: torch.Tensor  # [R, H] bool: the head runs the FA side (cfg.fa_mode)
    modes: torch.Tensor  # [R, H] int8 HeadMode of prompt queries (the request's table)
    step_modes: torch.Tensor  # [R, H] int8 HeadMode of this step's queries (decode-phase rows: decode_mode)


def thresholds(bias: float | torch.Tensor, sa_margin: float) -> torch.Tensor:
    """float32 thresholds: a head is FA iff z_FA - z_SA > threshold. ``bias`` a float or a float64 tensor [R];
    ``bias - sa_margin`` is taken in float64 and rounded to float32 once, the value the kernel receives."""
    if isinstance(bias, torch.Tensor):
        return (bias.double() - float(sa_margin)).float()
    return torch.tensor(float(bias) - float(sa_margin), dtype=torch.float64).float()


_MODE_SCALARS: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def head_modes(fa: torch.Tensor, cfg: ElasticConfig) -> torch.Tensor:
    """bool FA? -> HeadMode (int8): FA -> cfg.fa_mode, SA -> cfg.sa_mode. The two mode scalars are device
    tensors made once per device (not two host-to-device copies per layer)."""
    key = (fa.device, int(cfg.fa_mode), int(cfg.sa_mode))
    pair = _MODE_SCALARS.get(key)
    if pair is None:
        pair = _MODE_SCALARS[key] = tuple(torch.tensor(v, dtype=torch.int8, device=fa.device) for v in key[1:])
    return torch.where(fa, pair[0], pair[1])


def decode_modes(modes: torch.Tensor, decode_mode: str) -> torch.Tensor:
    """Head modes of decode-phase queries: ``dense`` -> every head FA (the paper); ``sparse`` -> SSA heads keep
    their sink + window, XA (block-sparse prefill) heads attend densely."""
    if decode_mode == "dense":
        return torch.zeros_like(modes)
    return torch.where(modes == HeadMode.SSA, modes, torch.zeros_like(modes))


def _force_codes(force: str | torch.Tensor, rows: int, device) -> torch.Tensor | None:
    """[R, 1] int force codes, or None when every row is ``auto``."""
    if isinstance(force, str):
        if force not in FORCE_CODE:
            raise ValueError(f"force: expected one of {sorted(FORCE_CODE)}, got {force!r}")
        return None if force == "auto" else torch.full((rows, 1), FORCE_CODE[force], device=device)
    return force.view(-1, 1)


def route_heads(
    logits: torch.Tensor | None,
    cfg: ElasticConfig,
    *,
    num_heads: int | None = None,
    force: str | torch.Tensor = "auto",
    bias: float | torch.Tensor = 0.0,
    budget: torch.Tensor | None = None,
    floor: torch.Tensor | None = None,
    decode_phase: torch.Tensor | None = None,
) -> HeadRouting:
    """The routing of R rows at one layer (the module docstring's rule).

    logits [R, H, 2] float32, or None when no row is ``auto`` (then ``num_heads`` and a tensor ``force`` or
    ``decode_phase`` give R, H and the device; every row must be forced). ``force``: one of ``FORCE_CODE`` for every row, or [R] int codes.
    ``bias``: a float, or float64 [R] (each row's own). ``budget``: [R] long SA heads of the row at this layer,
    < 0 for rows without a budget; None: no row has one. ``floor``: [H] bool, heads FA in ``auto`` rows.
    ``decode_phase``: [R] bool, rows whose queries lie past the prompt."""
    if logits is None:
        ref = force if isinstance(force, torch.Tensor) else decode_phase
        if num_heads is None or ref is None:
            raise ValueError("route_heads: without logits, num_heads and a per-row force or decode_phase are needed")
        if isinstance(force, str) and force == "auto":  # a tensor of codes: the caller knows no row is auto
            raise RuntimeError("elastic: a request needs the router but none is loaded")
        fa = torch.zeros(ref.shape[0], num_heads, dtype=torch.bool, device=ref.device)
    else:
        thr = thresholds(bias, cfg.sa_margin).to(logits.device)
        fa = decide(logits, -(thr.view(-1, 1) if thr.dim() else thr))
        if floor is not None:
            fa = fa | floor.to(fa.device)
        if budget is not None:
            fa = torch.where(budget.view(-1, 1) >= 0, decide_budget(logits, budget.clamp(min=0), floor), fa)
    codes = _force_codes(force, fa.shape[0], fa.device)
    if codes is not None:
        fa = torch.where(codes == FORCE_CODE["all-FA"], True, torch.where(codes == FORCE_CODE["all-SA"], False, fa))
    modes = head_modes(fa, cfg)
    step = modes
    if decode_phase is not None:
        step = torch.where(decode_phase.view(-1, 1).bool(), decode_modes(modes, cfg.decode_mode), modes)
    return HeadRouting(fa, modes, step)


def floor_count(fa_floor: int | float, num_layers: int, num_kv_heads: int) -> int:
    """KV heads in the floor: ``fa_floor`` itself (a count), or round-half-up(share x L x H) (a share in (0, 1))."""
    total = num_layers * num_kv_heads
    n = fa_floor if isinstance(fa_floor, int) else int(fa_floor * total + 0.5)
    if n > total:
        raise ValueError(f"fa_floor: {fa_floor} heads, but the model has {num_layers} x {num_kv_heads} = {total}")
    return n


def floor_mask(scores: torch.Tensor, fa_floor: int | float) -> torch.Tensor:
    """bool [L, H]: the floor's heads, the ``floor_count`` highest retrieval scores of the whole model (ties to
    the lower flat index). ``scores`` [L, H] float: the ranking a router checkpoint stores."""
    L, H = scores.shape
    n = floor_count(fa_floor, L, H)
    order = torch.sort(-scores.flatten().double(), stable=True).indices
    mask = torch.zeros(L * H, dtype=torch.bool)
    mask[order[:n]] = True
    return mask.view(L, H)


class RoutingTables(NamedTuple):
    """Where routings go (vLLM backend). ``step_modes`` [L, B, H]: the mode of every batch row's heads at this
    step (what each layer's attention kernel reads); per request slot s, its final routing: ``modes``
    [S, L, H] HeadMode of prompt queries, ``fa`` [S, L, H] bool, ``logits`` [S, L, H, 2] float32 and
    ``pooled`` [S, L, H, D] (optional: recorded router inputs). Contiguous (the kernel epilogue derives the
    strides from L and B)."""

    step_modes: torch.Tensor
    modes: torch.Tensor
    fa: torch.Tensor
    logits: torch.Tensor
    pooled: torch.Tensor | None = None

    def write(
        self,
        layer: int,
        rows: torch.Tensor,
        final_idx: torch.Tensor,
        final_slots: torch.Tensor,
        routing: HeadRouting,
        logits: torch.Tensor,
        pooled: torch.Tensor | None = None,
    ) -> None:
        """Write the routing of R rows at ``layer``: ``step_modes`` of batch rows ``rows`` [R] long; for the rows
        ``final_idx`` [F] whose routing is final, their slots ``final_slots`` [F] of the per-request tables."""
        self.step_modes[layer].index_copy_(0, rows, routing.step_modes.to(self.step_modes.dtype))
        if final_idx.numel():
            f, s = final_idx, final_slots
            self.modes[s, layer] = routing.modes.index_select(0, f).to(self.modes.dtype)
            self.fa[s, layer] = routing.fa.index_select(0, f).to(self.fa.dtype)
            self.logits[s, layer] = logits.index_select(0, f)
            if self.pooled is not None and pooled is not None:
                self.pooled[s, layer] = pooled.index_select(0, f)


def floor_value(router, cfg: ElasticConfig) -> int | float:
    """The floor ``cfg.fa_floor`` asks of ``router``: its value when set; unset (None), ``FA_FLOOR_DEFAULT``
    where the router holds a retrieval-head ranking and 0 where it holds none (a crafted or converted router has
    no ranking to keep; the startup log says which)."""
    if cfg.fa_floor is not None:
        return cfg.fa_floor
    return FA_FLOOR_DEFAULT if getattr(router, "retrieval_scores", None) is not None else 0


def floor_of(router, cfg: ElasticConfig, where: object = "the router") -> torch.Tensor | None:
    """bool [L, H_kv] floor mask of the whole model for ``cfg.fa_floor`` from ``router.retrieval_scores`` (the
    checkpoint's ranking); None when the floor is off or no router routes. A floor set > 0 with a router without
    a ranking is a ConfigError naming the command that adds one."""
    if router is None:
        return None
    floor = floor_value(router, cfg)
    if not floor:
        return None
    scores = getattr(router, "retrieval_scores", None)
    if scores is None:
        raise ConfigError(
            f"elastic.fa_floor {floor} needs the retrieval-head ranking of the router, but {where} has "
            f"none: add it with `elastic-vllm router-rank {where if where != 'the router' else 'ROUTER_DIR'} "
            "--model MODEL_DIR` (measures it and stores it in router.json), or set fa_floor 0"
        )
    try:
        return floor_mask(scores, floor)
    except ValueError as e:
        raise ConfigError(f"invalid elastic config: elastic.{e}") from None


def describe_floor(router, cfg: ElasticConfig, mask: torch.Tensor | None) -> str:
    """One line for the startup log: how many heads the floor keeps FA, and why."""
    if router is None:
        return "fa_floor: no router"
    how = "set" if cfg.fa_floor is not None else f"default {FA_FLOOR_DEFAULT}"
    if mask is None:
        why = "" if cfg.fa_floor is not None else ", the router holds no retrieval ranking (elastic-vllm router-rank)"
        return f"fa_floor: off ({how}{why})"
    return f"fa_floor: {int(mask.sum())} of {mask.numel()} KV heads FA ({how})"
