"""The routing policy (``router/policy.py``) against plain-Python references, and the vLLM torch glue against it.
The fused kernel's epilogue is checked against the same function in tests/kernels/test_route.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.router.policy import FORCE_CODE, RoutingTables, floor_count, floor_mask, route_heads

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)


def ref_row(margins, force, bias, sa_margin, n_sa, floor, fa_mode, sa_mode, decode_phase, decode_mode):
    """One row in plain Python: (fa, prompt modes, this step's modes)."""
    H = len(margins)
    finite = [math.isfinite(m) for m in margins]
    if n_sa is None:  # threshold in float32, then the floor
        thr = np.float32(bias - sa_margin)
        fa = [not finite[h] or bool(np.float32(margins[h]) > thr) or floor[h] for h in range(H)]
    else:  # floor heads last, then non-finite, then by margin, then head index
        key = sorted(range(H), key=lambda h: (floor[h], not finite[h], margins[h] if finite[h] else 0.0, h))
        sa = set(key[:n_sa])
        fa = [h not in sa for h in range(H)]
    if force == "all-FA":
        fa = [True] * H
    elif force == "all-SA":
        fa = [False] * H
    modes = [fa_mode if f else sa_mode for f in fa]
    if not decode_phase:
        step = modes
    elif decode_mode == "dense":
        step = [FA] * H
    else:
        step = [m if m == SSA else FA for m in modes]
    return fa, modes, step


@pytest.mark.parametrize("mode", ["FA-SSA", "FA-XA", "XA-SSA"])
@pytest.mark.parametrize("decode_mode", ["dense", "sparse"])
@pytest.mark.parametrize("use_floor", [False, True])
def test_route_heads_matches_the_reference_on_a_grid(mode, decode_mode, use_floor):
    gen = torch.Generator().manual_seed(7)
    H = 6
    forces = ["auto", "all-FA", "all-SA"]
    biases = [0.0, 1.5, -2.0]
    budgets = [None, 0, 2, 5, 6]
    rows = [(f, b, n, p) for f in forces for b in biases for n in budgets for p in (False, True) if n is None or b == 0]
    R = len(rows)
    z = torch.randn(R, H, 2, generator=gen) * 3
    z[::5, 1, 0] = float("nan")  # non-finite logits: FA under a threshold, ranked after finite heads by a budget
    floor = torch.tensor([False, True, False, False, True, False]) if use_floor else torch.zeros(H, dtype=torch.bool)
    cfg = ElasticConfig(mode=mode, decode_mode=decode_mode, sa_margin=0.5)
    got = route_heads(
        z, cfg,
        force=torch.tensor([FORCE_CODE[f] for f, *_ in rows], dtype=torch.int8),
        bias=torch.tensor([b for _, b, *_ in rows], dtype=torch.float64),
        budget=torch.tensor([-1 if n is None else n for *_, n, _ in rows]),
        floor=floor if use_floor else None,
        decode_phase=torch.tensor([p for *_, p in rows]),
    )  # fmt: skip
    margins = (z[..., 1] - z[..., 0]).tolist()
    for r, (f, b, n, p) in enumerate(rows):
        fa, modes, step = ref_row(margins[r], f, b, 0.5, n, floor.tolist(), int(cfg.fa_mode), int(cfg.sa_mode), p,
                                  decode_mode)  # fmt: skip
        assert got.fa[r].tolist() == fa, rows[r]
        assert got.modes[r].tolist() == modes and got.step_modes[r].tolist() == step, rows[r]
        if n is not None and f == "auto":
            assert int((~got.fa[r]).sum()) == n  # a budget is exact, floor or not


def test_floor_semantics():
    """Floor heads are FA in auto rows whatever the router and the bias; a force overrides the floor; a budget
    stays exact and takes the floor heads last."""
    cfg = ElasticConfig()
    z = torch.tensor([[[0.0, -5.0], [0.0, -9.0], [0.0, 3.0], [0.0, -1.0]]])  # margins -5, -9, 3, -1
    floor = torch.tensor([False, True, False, False])
    plain = route_heads(z, cfg).fa[0].tolist()
    assert plain == [False, False, True, False]
    assert route_heads(z, cfg, floor=floor).fa[0].tolist() == [False, True, True, False]
    assert route_heads(z, cfg, floor=floor, bias=1e3).fa[0].tolist() == [False, True, False, False]
    assert not route_heads(z, cfg, floor=floor, force="all-SA").fa.any()
    assert route_heads(z, cfg, floor=floor, force="all-FA").fa.all()
    for n_sa, want in ((1, [False, True, True, True]), (2, [False, True, True, False]),
                       (3, [False, True, False, False]), (4, [False, False, False, False])):  # fmt: skip
        got = route_heads(z, cfg, floor=floor, budget=torch.tensor([n_sa])).fa[0].tolist()
        assert got == want, n_sa
    # without the floor the budget takes head 1 (the lowest margin) first
    assert route_heads(z, cfg, budget=torch.tensor([1])).fa[0].tolist() == [True, False, True, True]


def test_forced_rows_need_no_logits():
    cfg = ElasticConfig(decode_mode="sparse")
    got = route_heads(None, cfg, num_heads=3, force=torch.tensor([1, 2]), decode_phase=torch.tensor([False, True]))
    assert got.fa.tolist() == [[True] * 3, [False] * 3]
    assert got.step_modes.tolist() == [[FA] * 3, [SSA] * 3]
    with pytest.raises(RuntimeError, match="needs the router"):
        route_heads(None, cfg, num_heads=3, force="auto", decode_phase=torch.tensor([False]))


def test_floor_count_and_mask():
    assert floor_count(0, 30, 3) == 0 and floor_count(9, 30, 3) == 9
    assert floor_count(0.1, 30, 3) == 9 and floor_count(0.05, 30, 3) == 5  # 4.5 rounds half up
    with pytest.raises(ValueError, match="fa_floor: 91 heads, but the model has 30 x 3 = 90"):
        floor_count(91, 30, 3)
    scores = torch.tensor([[0.1, 0.5, 0.2], [0.5, 0.0, 0.9]])
    assert floor_mask(scores, 2).tolist() == [[False, True, False], [False, False, True]]
    # a tie at the cut goes to the lower flat index
    assert floor_mask(scores, 3).tolist() == [[False, True, False], [True, False, True]]
    assert not floor_mask(scores, 0).any() and floor_mask(scores, 6).all()


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton-logits"])
def test_vllm_glue_routes_through_the_policy(kernel):
    """``route_layer`` + ``RoutingTables.write`` (the engine's torch glue) equal ``route_heads`` on the router's
    logits, for rows with biases, a budget, a force and a decode phase, with a floor mask of the layer."""
    from test_sa_margin import _case

    from elastic_vllm.router.model import budget_sa_counts
    from elastic_vllm.vllm_plugin.routing import RouteRow, TritonRouter, build_route_batch, route_layer

    batch, rope, router, lens, _z, m = _case()
    R = len(lens)
    kinds = [dict(bias=m), dict(target=0.5), dict(force="all-SA"), dict(bias=-m)]
    rows = []
    for i, n in enumerate(lens):
        k = dict(kinds[i % 4])
        rows.append(RouteRow(i, n, k.pop("force", "auto"), i % 3 == 0, i if i % 2 else None, **k))
    counts = budget_sa_counts(0.5, 2, 0, 1, 2)
    rb = build_route_batch(rows, batch.block_table, 16, "boundary", 100, budget_sa=lambda t: counts)
    cfg = ElasticConfig(sa_margin=0.25 * m, decode_mode="sparse")
    floor = torch.tensor([[0, 0], [0, 1]], dtype=torch.int8)
    k = TritonRouter(router, rope, 2, 2, R, "cpu") if kernel else None
    logits, routing, _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2, kernel=k, floor=floor)
    want = route_heads(
        logits, cfg, force=torch.tensor([FORCE_CODE[r.force] for r in rows]),
        bias=torch.tensor([r.bias for r in rows], dtype=torch.float64),
        budget=torch.tensor([counts[1] if r.target is not None else -1 for r in rows]),
        floor=torch.tensor([False, True]), decode_phase=torch.tensor([r.decode_phase for r in rows]),
    )  # fmt: skip
    for got, exp in zip(routing, want):
        assert torch.equal(got, exp)
    assert routing.fa[:, 1][[i for i, r in enumerate(rows) if r.force == "auto"]].all()  # the floor head
    tables = RoutingTables(
        torch.full((2, R, 2), -7, dtype=torch.int32), torch.full((R, 2, 2), -7, dtype=torch.int8),
        torch.zeros(R, 2, 2, dtype=torch.bool), torch.zeros(R, 2, 2, 2),
    )  # fmt: skip
    tables.write(1, rb.rows, rb.final_idx, rb.final_slots, routing, logits)
    assert torch.equal(tables.step_modes[1], want.step_modes.int())
    for i, r in enumerate(rows):
        if r.final_slot is not None:
            assert torch.equal(tables.modes[r.final_slot, 1], want.modes[i])
            assert torch.equal(tables.fa[r.final_slot, 1], want.fa[i])
            assert torch.equal(tables.logits[r.final_slot, 1], logits[i])
        else:
            assert (tables.modes[i] == -7).all()
