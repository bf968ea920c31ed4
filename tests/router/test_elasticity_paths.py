"""Per-request bias and fixed budgets in every routing path against the reference decisions
(``router.model.decide`` / ``decide_budget``): the vLLM backend's torch glue, its fused Triton router
(TRITON_INTERPRET=1) with a bias every row shares, and the transformers integration (``set_config``)."""

from __future__ import annotations

import math

import pytest
import torch
from test_sa_margin import _case, poisoned_tables, tiny_elastic

from elastic_vllm.config import ConfigError, ElasticConfig
from elastic_vllm.router.model import budget_sa_counts, decide, decide_budget, effective_margin


def test_fused_router_applies_a_shared_bias_like_the_glue():
    """Rows sharing one bias (the load policy's level, or one client's) keep the fused kernel: its margin is the
    server's less that bias, and it decides as the torch glue does."""
    from elastic_vllm.vllm_plugin.routing import RouteRow, TritonRouter, build_route_batch, route_layer

    batch, rope, router, lens, z, m = _case()
    R = len(lens)
    k = TritonRouter(router, rope, 2, 2, R, "cpu")
    for bias in (m, -m):
        rows = [RouteRow(i, n, "auto", False, i, bias=bias) for i, n in enumerate(lens)]
        rb = build_route_batch(rows, batch.block_table, 16, "boundary", 100)
        assert not rb.needs_glue and rb.uniform_bias == bias
        cfg = ElasticConfig(sa_margin=0.25 * m)
        tables = poisoned_tables(R)
        k.route_into(1, batch.key_cache, rb, cfg, tables)
        want = decide(z, effective_margin(cfg.sa_margin, bias))
        sure = ((z[..., 1] - z[..., 0]) - bias + cfg.sa_margin).abs() > 1e-4
        assert torch.equal(tables[2][:, 1][sure], want[sure])
        _, (fa, _, _), _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2)
        assert torch.equal(fa[sure], want[sure])


def test_fused_router_applies_a_bias_per_row():
    """Rows with different biases (clients' own, load levels) keep the fused kernel too: each row its own float32
    threshold bias - sa_margin, the same decisions as the torch glue."""
    from elastic_vllm.vllm_plugin.routing import RouteRow, TritonRouter, build_route_batch, route_layer

    batch, rope, router, lens, z, m = _case()
    R = len(lens)
    k = TritonRouter(router, rope, 2, 2, R, "cpu")
    biases = [m, -m, 0.0, 0.5 * m]
    rows = [RouteRow(i, n, "auto", False, i, bias=biases[i]) for i, n in enumerate(lens)]
    rb = build_route_batch(rows, batch.block_table, 16, "boundary", 100)
    assert not rb.needs_glue and rb.uniform_bias is None
    cfg = ElasticConfig(sa_margin=0.25 * m)
    tables = poisoned_tables(R)
    k.route_into(1, batch.key_cache, rb, cfg, tables)
    _, (glue, _, _), _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2)
    seen = set()
    for i, bias in enumerate(biases):
        want = decide(z[i], effective_margin(cfg.sa_margin, bias))
        sure = ((z[i, :, 1] - z[i, :, 0]) - bias + cfg.sa_margin).abs() > 1e-4
        assert torch.equal(tables[2][i, 1][sure], want[sure]), i
        assert torch.equal((tables[1][i, 1] == 0)[sure], want[sure]), i
        assert torch.equal(glue[i][sure], want[sure]), i
        seen.add(tuple(want.tolist()))
    assert len(seen) > 1  # the biases make the rows decide differently
    from dataclasses import replace

    from elastic_vllm.ops.route.kernel import RouteEpilogue, check_epilogue

    ep = RouteEpilogue(rb.row_info, rb.thresholds(cfg.sa_margin), k.no_floor, tables, False)
    check_epilogue(ep, R, 2, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="thresholds"):
        check_epilogue(replace(ep, thresholds=ep.thresholds.double()), R, 2, 2, torch.device("cpu"))


def test_glue_mixes_biases_budgets_and_plain_rows():
    from elastic_vllm.vllm_plugin.routing import RouteRow, build_route_batch, route_layer

    batch, rope, router, lens, _z, m = _case()
    kinds = [dict(bias=m), dict(target=0.5), dict(), dict(bias=-m)]
    rows = [RouteRow(i, n, "auto", False, None, **kinds[i % 4]) for i, n in enumerate(lens)]
    rb = build_route_batch(
        rows, batch.block_table, 16, "boundary", 100, budget_sa=lambda t: budget_sa_counts(t, 2, 0, 1, 2)
    )
    assert rb.needs_glue and rb.budget is not None
    cfg = ElasticConfig()
    logits, (fa, _, _), _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2)
    for i, r in enumerate(rows):
        if r.target is not None:
            n_sa = budget_sa_counts(0.5, 2, 0, 1, 2)[1]
            assert torch.equal(fa[i], decide_budget(logits[i : i + 1], torch.tensor([n_sa]))[0])
            assert int((~fa[i]).sum()) == n_sa
        else:
            assert torch.equal(fa[i], decide(logits[i], effective_margin(0.0, r.bias))), i


def test_transformers_set_config_bias_and_target():
    model, state, _router, ids = tiny_elastic()  # 3 layers, 2 KV heads
    sa = []
    for bias in (-1e3, 0.0, 1e3):
        state.set_config(bias=bias)
        model(input_ids=ids)
        assert torch.equal(state.last_routing, decide(state.last_logits, effective_margin(0.0, bias)))
        sa.append(int((~state.last_routing).sum()))
    assert sa[0] == 0 and sa[2] == 2 * 3 * 2 and sa[0] <= sa[1] <= sa[2]
    state.set_config(bias=0.0)
    for target in (0.25, 0.5, 0.9):
        state.set_config(target_omega=target)
        model(input_ids=ids)
        want = math.floor(target * 3 * 2 + 0.5)
        assert (~state.last_routing).flatten(1).sum(1).tolist() == [want, want]  # exact per request
        counts = budget_sa_counts(target, 3, 0, 1, 2)
        for layer in range(3):
            n = torch.tensor([counts[layer]] * 2)
            assert torch.equal(state.last_routing[:, layer], decide_budget(state.last_logits[:, layer], n))
    with pytest.raises(ConfigError, match=r"bias and target_omega cannot be combined"):
        state.set_config(bias=1.0)
    with pytest.raises(ConfigError, match=r"elastic\.target_omega"):
        state.set_config(target_omega=float("nan"))
