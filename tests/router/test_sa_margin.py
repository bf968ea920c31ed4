"""ElasticConfig.sa_margin, the fail-safe routing margin: validated like every field, and applied identically
by every routing path against the reference ``router.model.decide`` (FA iff z_FA - z_SA > -sa_margin):
the vLLM backend's torch glue, its fused Triton router (under TRITON_INTERPRET=1), the transformers
integration. The kernel's own epilogue is tested in tests/kernels/test_route.py."""

from __future__ import annotations

import pytest
import torch

from elastic_vllm.config import SA_MARGIN_MAX, ConfigError, ElasticConfig
from elastic_vllm.hf.testing import sharp_router
from elastic_vllm.ops.route.naive import route_logits_ref
from elastic_vllm.reference.paged import make_paged_batch
from elastic_vllm.reference.rope import RopeSpec
from elastic_vllm.router.model import ElasticRouter, decide
from elastic_vllm.router.policy import RoutingTables


@pytest.mark.parametrize(
    "bad, msg",
    [
        (True, "elastic.sa_margin: Value error, must be a number"),
        ("0.5", "elastic.sa_margin: Value error, must be a number"),
        (None, "elastic.sa_margin: Value error, must be a number"),
        (float("nan"), "elastic.sa_margin: Input should be a finite number"),
        (float("inf"), "elastic.sa_margin: Input should be a finite number"),
        (SA_MARGIN_MAX + 1, "elastic.sa_margin: Input should be less than or equal to 1024"),
        (-SA_MARGIN_MAX - 1, "elastic.sa_margin: Input should be greater than or equal to -1024"),
    ],
)
def test_sa_margin_is_validated(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        ElasticConfig.parse({"sa_margin": bad})


def test_sa_margin_accepts_numbers():
    assert ElasticConfig().sa_margin == 0.0
    assert ElasticConfig.parse({"sa_margin": 3}).sa_margin == 3.0
    assert ElasticConfig.parse('{"sa_margin": -2.5}').sa_margin == -2.5


def test_decide_is_the_argmax_at_zero_and_shifts_by_the_margin():
    z = torch.tensor([[0.0, 1.0], [1.0, 0.0], [2.0, 2.0], [1.0, 0.5], [0.5, 3.0]])  # index 1 = FA
    assert decide(z).tolist() == (z.argmax(-1) == 1).tolist() == [True, False, False, False, True]
    assert decide(z, 0.5).tolist() == [True, False, True, False, True]  # SA by exactly 0.5 stays SA
    assert decide(z, 0.5 + 1e-6).tolist() == [True, False, True, True, True]
    assert decide(z, -2.0).tolist() == [False, False, False, False, True]  # FA needs z_FA - z_SA > 2
    assert decide(z, -2.5).tolist() == [False, False, False, False, False]


def _case(margin_quantile=0.5):
    lens = [300, 150, 220, 90]
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch(lens, lens, 2, 2, 16, block_size=16, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rope = RopeSpec(inv, 1.0, 16, 16)
    torch.manual_seed(0)
    router = ElasticRouter(2, 16)
    rows = torch.arange(len(lens), dtype=torch.int32)
    plens = torch.tensor(lens, dtype=torch.int32)
    z = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, 1, rope)
    d = (z[..., 1] - z[..., 0]).flatten()
    with torch.no_grad():  # centre on the median so both decisions occur
        router.layers[1].cls_router_head_agnostic[4].bias[1] -= d.median()
    z = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, 1, rope)
    d = z[..., 1] - z[..., 0]
    m = float((-d[d < 0]).quantile(margin_quantile))
    return batch, rope, router, lens, z, m


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton-logits"])
def test_vllm_route_layer_applies_the_margin(kernel):
    from elastic_vllm.vllm_plugin.routing import RouteRow, TritonRouter, build_route_batch, route_layer

    batch, rope, router, lens, z, m = _case()
    rows = [RouteRow(i, n, "auto", False, None) for i, n in enumerate(lens)]
    rb = build_route_batch(rows, batch.block_table, 16, "boundary", 100)
    k = TritonRouter(router, rope, 2, 2, len(lens), "cpu") if kernel else None
    seen = []
    for margin in (0.0, m, -m):
        cfg = ElasticConfig(sa_margin=margin)
        logits, (fa, _modes, _), _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2, kernel=k)
        sure = ((z[..., 1] - z[..., 0]) + margin).abs() > 1e-4
        assert torch.equal(fa[sure], decide(z, margin)[sure])
        assert torch.equal(fa, decide(logits, margin))
        seen.append(int(fa.sum()))
    assert seen[1] > seen[0] > seen[2]


def poisoned_tables(R: int) -> RoutingTables:
    """(row_modes, table_modes, table_fa, table_logits) of R rows, 2 layers, 2 KV heads; modes -7: unwritten."""
    return RoutingTables(
        torch.full((2, R, 2), -7, dtype=torch.int8),
        torch.full((R, 2, 2), -7, dtype=torch.int8),
        torch.zeros(R, 2, 2, dtype=torch.bool),
        torch.zeros(R, 2, 2, 2),
    )


def test_vllm_fused_route_into_applies_the_margin():
    """The engine's fast path: the router kernel writes the per-request tables itself (RouteEpilogue)."""
    from elastic_vllm.vllm_plugin.routing import RouteRow, TritonRouter, build_route_batch

    batch, rope, router, lens, z, m = _case()
    R = len(lens)
    rows = [RouteRow(i, n, "auto", False, i) for i, n in enumerate(lens)]
    rb = build_route_batch(rows, batch.block_table, 16, "boundary", 100)
    k = TritonRouter(router, rope, 2, 2, R, "cpu")
    for margin in (0.0, m):
        cfg = ElasticConfig(sa_margin=margin, decode_mode="sparse")
        tables = poisoned_tables(R)
        k.route_into(1, batch.key_cache, rb, cfg, tables)
        sure = ((z[..., 1] - z[..., 0]) + margin).abs() > 1e-4
        assert torch.equal(tables[2][:, 1][sure], decide(z, margin)[sure])
        assert torch.equal((tables[1][:, 1] == 0)[sure], decide(z, margin)[sure])


def tiny_elastic():
    """(model, its ElasticState, router, input ids [2, 40]): the tiny llama (3 layers, 2 KV heads) with a random
    router whose last layer is scaled so that its logits differ by more than float32 noise."""
    from elastic_vllm.hf import enable_elastic
    from elastic_vllm.hf.testing import tiny_model

    router = sharp_router(seed=0)
    model = tiny_model("llama")
    state = enable_elastic(model, {"sink": 4, "window": 12}, router)
    return model, state, router, torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def test_transformers_path_applies_the_margin():
    model, state, router, ids = tiny_elastic()
    model(input_ids=ids)
    z0 = state.last_logits[:, 0].clone()  # layer 0's keys do not depend on any routing; later layers' do
    with torch.no_grad():  # 4 heads at layer 0: centre them so that two prefer SA
        router.layers[0].cls_router_head_agnostic[4].bias[1] -= (z0[..., 1] - z0[..., 0]).median() + 1e-3
    model(input_ids=ids)
    z0 = state.last_logits[:, 0].clone()
    d = z0[..., 1] - z0[..., 0]
    m = float((-d[d < 0]).max()) + 1e-3  # every SA head of layer 0 turns FA
    counts = []
    for margin in (0.0, m, -m):
        state.set_config(sa_margin=margin)
        model(input_ids=ids)
        torch.testing.assert_close(state.last_logits[:, 0], z0)
        assert torch.equal(state.last_routing, decide(state.last_logits, margin))
        counts.append(int(state.last_routing[:, 0].sum()))
    assert counts[1] == 4 > counts[0] >= counts[2]
    with pytest.raises(ConfigError, match=r"elastic\.sa_margin"):
        state.set_config(sa_margin=True)
