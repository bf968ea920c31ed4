"""Router kernel (elastic_vllm/ops/route/kernel.py) against ElasticRouter + pool_keys + invert_rope, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kutils import no_host_sync, strided_caches

from elastic_vllm.ops.route.kernel import (
    _sincos,
    pack_router_norm,
    pack_router_weights,
    packed_row_len,
    route,
    router_param_count,
)
from elastic_vllm.ops.route.naive import route_logits_ref
from elastic_vllm.reference.paged import make_paged_batch
from elastic_vllm.reference.rope import RopeSpec
from elastic_vllm.router.model import ElasticRouter, num_parameters_per_layer

LOGIT_ATOL = 2e-5  # fp32 throughout; only summation order differs


def make_case(lens, hkv=4, d=32, rot=24, scaling=1.3, layers=3, pool=100, seed=0, bs=16, norm=False):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(lens, lens, hkv, hkv, d, block_size=bs, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    spec = RopeSpec(inv, scaling, rot, d)
    torch.manual_seed(seed)
    router = ElasticRouter(layers, d)
    if norm:  # a per-(layer, head, dim) input standardization, as training fixes it
        router.set_input_norm(
            torch.randn(layers, hkv, d, generator=gen), torch.rand(layers, hkv, d, generator=gen) + 0.5
        )
    rows = torch.arange(len(lens), dtype=torch.int32)
    plens = torch.tensor(lens, dtype=torch.int32)
    # centre the final bias on the median logit margin so decisions are mixed, not all one way
    for layer in range(layers):
        z = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, layer, spec, pool_tokens=pool)
        margin = (z[..., 1] - z[..., 0]).flatten()
        router.layers[layer].cls_router_head_agnostic[4].bias.data[1] -= margin.median()
    return batch, spec, router, rows, plens


def check(batch, spec, router, rows, plens, layer, slots, table, pool=100, pooling="boundary", kc=None, **kw):
    logits = torch.full((rows.shape[0], batch.key_cache.shape[2], 2), float("nan"))
    before = table.clone()
    route(
        batch.key_cache if kc is None else kc, batch.block_table, rows, plens, slots, pack_router_weights(router),
        layer, table, inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling, pool_tokens=pool,
        pooling=pooling, logits_out=logits, **kw,
    )  # fmt: skip
    want = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, layer, spec, pooling, pool)
    torch.testing.assert_close(logits, want, atol=LOGIT_ATOL, rtol=1e-5)
    fa = want[..., 1] > want[..., 0]
    sure = (want[..., 1] - want[..., 0]).abs() > 10 * LOGIT_ATOL
    got = table[slots.long(), layer]
    fa_v, sa_v = kw.get("fa_value", 0), kw.get("sa_value", 1)
    expect = torch.where(fa, fa_v, sa_v).to(table.dtype)
    assert torch.equal(got[sure], expect[sure])
    assert fa.any() and (~fa).any(), "the case should mix FA and SA decisions"
    untouched = torch.ones(table.shape[0], table.shape[1], dtype=torch.bool)
    untouched[slots.long(), layer] = False
    assert torch.equal(table[untouched], before[untouched])


@pytest.mark.parametrize("num_chunks", [None, 1, 2, 4], ids=["default", "1", "2", "4"])
def test_route_matches_reference(num_chunks):
    lens = [1, 7, 199, 200, 201, 450]  # shorter than, equal to and longer than 2 * pool_tokens
    batch, spec, router, rows, plens = make_case(lens)
    table = torch.full((8, 3, 4), 9, dtype=torch.int8)
    slots = torch.tensor([6, 0, 3, 1, 7, 2], dtype=torch.int32)
    check(batch, spec, router, rows, plens, 1, slots, table, num_chunks=num_chunks)


@pytest.mark.parametrize("pool", [100, 300], ids=["fused-pool", "pooling-launch"])
def test_route_with_input_norm_matches_reference(pool):
    """The router's per-(layer, KV head) input standardization is applied in the kernel (rotary
    halves and the unrotated tail) exactly as ElasticRouter applies it."""
    lens = [1, 150, 450, 700]
    batch, spec, router, rows, plens = make_case(lens, pool=pool, norm=True, seed=3)
    table = torch.full((4, 3, 4), 9, dtype=torch.int8)
    slots = torch.arange(4, dtype=torch.int32)
    check(batch, spec, router, rows, plens, 2, slots, table, pool=pool, norm=pack_router_norm(router))
    # without the norm the kernel would compute other logits: the test can fail
    plain = torch.empty(4, 4, 2)
    route(
        batch.key_cache, batch.block_table, rows, plens, slots, pack_router_weights(router), 2, table.clone(),
        inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling, pool_tokens=pool, logits_out=plain,
    )  # fmt: skip
    want = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, 2, spec, pool_tokens=pool)
    assert (plain - want).abs().max() > 1e-3


def test_route_long_boundary_pool_uses_the_pooling_launch():
    """2 * pool_tokens > FUSED_POOL_MAX: a token-parallel pooling launch feeds the Task-MLP launch."""
    from elastic_vllm.ops.route.kernel import FUSED_POOL_MAX

    pool = FUSED_POOL_MAX // 2 + 20
    batch, spec, router, rows, plens = make_case([2 * pool + 77, 300, 5], layers=2, pool=pool, seed=9)
    table = torch.full((3, 2, 4), 9, dtype=torch.int8)
    check(batch, spec, router, rows, plens, 1, torch.tensor([2, 0, 1], dtype=torch.int32), table, pool=pool)


@triton.jit
def _sincos_kernel(x_ptr, s_ptr, c_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    s, c = _sincos(tl.load(x_ptr + o))
    tl.store(s_ptr + o, s)
    tl.store(c_ptr + o, c)


def test_sincos_matches_torch_at_large_angles():
    """The kernel's sin/cos (Cody-Waite + polynomials) on the reference's fp32 angles up to 1M tokens."""
    pos = torch.tensor([0, 1, 2, 99, 4095, 8191, 105615, 131071, 262143, 1048575] * 2, dtype=torch.float32)
    inv = torch.tensor([1.0] * 10 + [0.8659643, 0.0372759, 3.3e-4, 0.7498942, 0.9, 0.5, 1e-5, 0.2, 0.3, 0.99])
    x = pos * inv  # float32 products, as RopeSpec.cos_sin
    x = torch.cat([x, torch.zeros(32 - x.numel())])
    s, c = torch.empty_like(x), torch.empty_like(x)
    _sincos_kernel[(1,)](x, s, c, N=32)
    torch.testing.assert_close(s, x.double().sin().float(), atol=3e-7, rtol=0)
    torch.testing.assert_close(c, x.double().cos().float(), atol=3e-7, rtol=0)


def test_route_whole_pooling_full_rotary_d64_strided_cache():
    batch, spec, router, rows, plens = make_case([300, 33, 90], hkv=2, d=64, rot=64, scaling=1.0, layers=2, seed=3)
    kc, _ = strided_caches(batch)
    table = torch.zeros(3, 2, 2, dtype=torch.int32)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    check(batch, spec, router, rows, plens, 0, slots, table, pooling="whole", kc=kc, fa_value=2, sa_value=1)


def test_route_small_pool_and_row_subset():
    batch, spec, router, _rows, plens = make_case([50, 9, 31, 64], pool=5, seed=5)
    sub = torch.tensor([3, 1], dtype=torch.int32)  # route only some rows of the batch
    table = torch.full((4, 3, 4), 9, dtype=torch.int8)
    check(batch, spec, router, sub, plens[sub.long()], 2, torch.tensor([0, 2], dtype=torch.int32), table, pool=5)


def test_packed_weights_layout():
    router = ElasticRouter(2, 32)
    w = pack_router_weights(router)
    n = router_param_count(32, 128)
    assert n == num_parameters_per_layer(32)
    assert w.shape == (2, packed_row_len(32, 128)) and w.shape[1] % 16 == 0 and 0 < w.shape[1] - n < 16
    assert torch.equal(w[1, : 128 * 32], router.layers[1].cls_feat_extractor[0].weight.flatten())
    assert torch.equal(w[0, n - 2 : n], router.layers[0].cls_router_head_agnostic[4].bias)
    assert not w[:, n:].any()


def test_route_accepts_unpadded_rows():
    """Rows of exactly router_param_count floats (no alignment padding) give the same logits."""
    batch, spec, router, rows, plens = make_case([90, 33], seed=4)
    padded = pack_router_weights(router)
    bare = padded[:, : router_param_count(32, 128)].contiguous()
    out = []
    for w in (padded, bare):
        lg = torch.full((2, 4, 2), float("nan"))
        route(batch.key_cache, batch.block_table, rows, plens, rows, w, 1, torch.zeros(2, 3, 4, dtype=torch.int8),
              inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling, logits_out=lg)  # fmt: skip
        out.append(lg)
    assert not out[0].isnan().any()
    torch.testing.assert_close(out[0], out[1], atol=LOGIT_ATOL, rtol=1e-5)


def test_route_no_host_sync():
    batch, spec, router, rows, plens = make_case([40, 250], seed=2)
    w = pack_router_weights(router)
    table = torch.zeros(2, 3, 4, dtype=torch.int8)
    with no_host_sync():
        route(batch.key_cache, batch.block_table, rows, plens, rows, w, 0, table, inv_freq=spec.inv_freq)


def test_route_launcher_errors_name_the_argument():
    batch, spec, router, rows, plens = make_case([20], layers=1)
    w = pack_router_weights(router)
    table = torch.zeros(1, 1, 4, dtype=torch.int8)
    a = (batch.key_cache, batch.block_table, rows, plens, rows)
    with pytest.raises(ValueError, match="weights"):
        route(*a, w[:, :-1].contiguous(), 0, table, inv_freq=spec.inv_freq)
    with pytest.raises(ValueError, match="layer"):
        route(*a, w, 1, table, inv_freq=spec.inv_freq)
    with pytest.raises(ValueError, match="table"):
        route(*a, w, 0, torch.zeros(1, 1, 3, dtype=torch.int8), inv_freq=spec.inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        route(*a, w, 0, table, inv_freq=torch.ones(40))
    with pytest.raises(ValueError, match="prompt_lens"):
        route(*a[:3], torch.ones(2, dtype=torch.int32), rows, w, 0, table, inv_freq=spec.inv_freq)
    with pytest.raises(ValueError, match="pooling"):
        route(*a, w, 0, table, inv_freq=spec.inv_freq, pooling="mean")
    with pytest.raises(ValueError, match="num_chunks"):
        route(*a, w, 0, table, inv_freq=spec.inv_freq, num_chunks=3)


def test_prepared_router_repeated_calls_rearm_counters():
    """The hot-path launcher: one validation, then many layers; the last-program counters re-arm."""
    from elastic_vllm.ops.route.kernel import Router

    batch, spec, router, rows, plens = make_case([120, 230], layers=3, seed=8)
    w = pack_router_weights(router)
    table = torch.full((2, 3, 4), 9, dtype=torch.int8)
    r = Router(w, table, inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling, num_kv_heads=4,
               head_dim=32, block_size=16, num_chunks=2)  # fmt: skip
    for layer in (2, 0, 1, 2):
        lg = torch.full((2, 4, 2), float("nan"))
        r(batch.key_cache, batch.block_table, rows, plens, rows, layer, lg)
        want = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, layer, spec)
        torch.testing.assert_close(lg, want, atol=LOGIT_ATOL, rtol=1e-5)
    assert (table != 9).all()
    assert int(r.workspace(2)[3].abs().sum()) == 0  # counters back at zero


def _epilogue(force, dphase, fslot, brow, thr, floor, L, batch_rows, slots, decode_dense):
    """A RouteEpilogue over poisoned tables: modes -7, fa False, logits NaN (entries that must stay untouched)."""
    from elastic_vllm.ops.route.kernel import RouteEpilogue
    from elastic_vllm.router.policy import RoutingTables

    hkv = floor.shape[1]
    tables = RoutingTables(
        torch.full((L, batch_rows, hkv), -7, dtype=torch.int32), torch.full((slots, L, hkv), -7, dtype=torch.int8),
        torch.zeros(slots, L, hkv, dtype=torch.bool), torch.full((slots, L, hkv, 2), float("nan")),
    )  # fmt: skip
    info = torch.stack([brow, force.int(), dphase.int(), fslot]).int().contiguous()
    return RouteEpilogue(row_info=info, thresholds=thr, floor=floor, tables=tables, decode_dense=decode_dense)


# the grid: every force, phase and final-slot case of a row, per-row biases, with and without a floor, each
# decode_mode and head-mode pair; the reference is router/policy.py's route_heads on the reference logits
@pytest.mark.parametrize("use_floor", [False, True], ids=["no-floor", "floor"])
@pytest.mark.parametrize("decode_mode, mode", [("sparse", "FA-SSA"), ("dense", "XA-SSA"), ("sparse", "FA-XA")])
def test_route_epilogue_matches_the_policy(decode_mode, mode, use_floor):
    """The fused epilogue (threshold per row, floor, force, decode-phase modes, this step's row modes and the
    per-request tables) equals ``policy.route_heads`` + ``RoutingTables.write`` applied to the reference logits;
    entries the epilogue must not touch keep their sentinels (-7 / NaN)."""
    from elastic_vllm.config import ElasticConfig
    from elastic_vllm.router.policy import RoutingTables, route_heads, thresholds

    lens = [300, 150, 220, 90, 260, 120]
    batch, spec, router, rows, plens = make_case(lens)
    R, hkv, L, layer = len(lens), batch.key_cache.shape[2], 3, 1
    z = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, layer, spec)
    m = float((z[..., 1] - z[..., 0]).abs().median())  # the logits' own scale: margins and biases move some heads
    cfg = ElasticConfig(mode=mode, decode_mode=decode_mode, sa_margin=0.25 * m)
    force = torch.tensor([0, 1, 2, 0, 0, 2], dtype=torch.int8)  # auto, all-FA, all-SA, auto, auto, all-SA
    dphase = torch.tensor([False, False, True, True, False, False])
    fslot = torch.tensor([3, -1, 0, 5, 1, -1], dtype=torch.int32)
    brow = torch.tensor([2, 0, 5, 4, 6, 1], dtype=torch.int32)  # batch rows of the routed rows
    bias = torch.tensor([0.0, 0.0, m, -0.5 * m, 0.5 * m, 0.0], dtype=torch.float64)
    floor = torch.zeros(L, hkv, dtype=torch.int8)
    if use_floor:
        floor[layer, 1] = floor[layer, 3] = floor[0, 0] = 1  # layer 0's entry must not leak into layer 1
    want = route_heads(z, cfg, force=force, bias=bias, floor=floor[layer].bool(), decode_phase=dphase)
    e = _epilogue(force, dphase, fslot, brow, thresholds(bias, cfg.sa_margin), floor, L, 7, 6, decode_mode == "dense")
    ref = RoutingTables(*(t.clone() for t in e.tables[:4]))
    ref.write(layer, brow.long(), (fslot >= 0).nonzero().squeeze(1), fslot[fslot >= 0].long(), want, z)
    route(
        batch.key_cache, batch.block_table, rows, plens, rows, pack_router_weights(router), layer,
        torch.zeros(R, L, hkv, dtype=torch.int8), inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling,
        fa_value=int(cfg.fa_mode), sa_value=int(cfg.sa_mode), epilogue=e,
    )  # fmt: skip
    near = ((z[..., 1] - z[..., 0]) - thresholds(bias, cfg.sa_margin)[:, None]).abs() <= 10 * LOGIT_ATOL
    near &= (force == 0)[:, None] & ~floor[layer].bool()  # a near-tie decides either way unless overridden
    assert not near.all(1).any(), "every row should have decided heads"
    got, exp = e.tables, ref
    for r in range(R):
        sure = ~near[r]
        assert torch.equal(got.step_modes[layer, brow[r]][sure], exp.step_modes[layer, brow[r]][sure]), r
        if fslot[r] >= 0:
            s = int(fslot[r])
            assert torch.equal(got.modes[s, layer][sure], exp.modes[s, layer][sure]), r
            assert torch.equal(got.fa[s, layer][sure], exp.fa[s, layer][sure]), r
            torch.testing.assert_close(got.logits[s, layer], z[r], atol=LOGIT_ATOL, rtol=1e-5)
    # outside the routed rows and final slots, nothing moved
    touched = torch.zeros(L, 7, dtype=torch.bool)
    touched[layer, brow.long()] = True
    assert (got.step_modes[~touched] == -7).all()
    final = torch.zeros(6, L, dtype=torch.bool)
    final[fslot[fslot >= 0].long(), layer] = True
    assert (got.modes[~final] == -7).all() and got.logits[~final].isnan().all() and not got.fa[~final].any()
    assert not got.logits[final].isnan().any()
    # the grid exercises what it claims: forced rows override, decisions mix, the floor turns SA heads FA
    fa = want.fa
    assert fa[1].all() and not fa[2].any() and fa[[0, 3, 4]].any() and not fa[[0, 3, 4]].all()
    if use_floor:
        plain = route_heads(z, cfg, force=force, bias=bias).fa
        assert (fa & ~plain)[:, [1, 3]].any() and torch.equal(fa[:, [0, 2]], plain[:, [0, 2]])


def test_route_epilogue_errors_name_the_table():
    from elastic_vllm.ops.route.kernel import RouteEpilogue
    from elastic_vllm.router.policy import RoutingTables

    batch, spec, router, rows, plens = make_case([120, 80])
    R, hkv, L = 2, batch.key_cache.shape[2], 3
    tables = RoutingTables(
        torch.zeros(L, 4, hkv, dtype=torch.int32), torch.zeros(3, L, hkv, dtype=torch.int8),
        torch.zeros(3, L, hkv, dtype=torch.bool), torch.zeros(3, L, hkv, 2),
    )  # fmt: skip
    good = dict(
        row_info=torch.zeros(4, R, dtype=torch.int32), thresholds=torch.zeros(R), floor=torch.zeros(L, hkv,
        dtype=torch.int8), tables=tables, decode_dense=True,
    )  # fmt: skip
    args = (batch.key_cache, batch.block_table, rows, plens, rows, pack_router_weights(router), 0,
            torch.zeros(R, L, hkv, dtype=torch.int8))  # fmt: skip
    for field, bad, msg in (
        ("row_info", torch.zeros(4, R, dtype=torch.int64), "row_info: dtype int64 not supported"),
        ("row_info", torch.zeros(R, 4, dtype=torch.int32).t(), "row_info: must be contiguous"),
        ("thresholds", torch.zeros(R, dtype=torch.float64), "thresholds: dtype float64 not supported"),
        ("floor", torch.zeros(L, hkv + 1, dtype=torch.int8), "floor: dimension 1 is 5, expected 4"),
        ("tables", tables._replace(step_modes=torch.zeros(L + 1, 4, hkv, dtype=torch.int32)),
         "step_modes: dimension 0 is 4, expected 3"),
        ("tables", tables._replace(logits=torch.zeros(3, L, hkv, 3)), "logits: dimension 3 is 3, expected 2"),
        ("tables", tables._replace(fa=torch.zeros(2, L, hkv, dtype=torch.bool)), "fa: dimension 0 is 2, expected 3"),
        ("tables", tables._replace(modes=torch.zeros(L, 3, hkv, dtype=torch.int8).transpose(0, 1)),
         "modes: must be contiguous"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            route(*args, inv_freq=spec.inv_freq, epilogue=RouteEpilogue(**{**good, field: bad}))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_route_nonfinite_logits_go_to_fa(bad):
    """A router whose logits are NaN / inf sends those heads to FA, as router.model.decide does (the kernel's
    `z1 > z0` said SA for every NaN)."""
    lens = [7, 201, 450]
    batch, spec, router, rows, plens = make_case(lens)
    router.layers[1].cls_router_head_agnostic[4].bias.data[0] = bad  # the SA logit of every head of layer 1
    table = torch.full((4, 3, 4), 9, dtype=torch.int8)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    logits = torch.zeros(3, 4, 2)
    route(
        batch.key_cache, batch.block_table, rows, plens, slots, pack_router_weights(router), 1, table,
        inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling, pool_tokens=100, logits_out=logits,
        fa_value=0, sa_value=1,
    )  # fmt: skip
    assert not torch.isfinite(logits[..., 0]).any()
    assert (table[slots.long(), 1] == 0).all(), table[slots.long(), 1]


def test_route_sa_margin_matches_decide():
    """The decision epilogue with ``sa_margin``: table and engine tables equal ``router.model.decide(z, m)``
    (FA iff z1 - z0 > -m, float32) on the reference logits, and a positive margin turns some SA heads FA."""
    from elastic_vllm.router.model import decide
    from elastic_vllm.router.policy import thresholds

    lens = [300, 150, 220, 90]
    batch, spec, router, rows, plens = make_case(lens)
    R, hkv, L, layer = len(lens), batch.key_cache.shape[2], 3, 2
    z = route_logits_ref(batch.key_cache, batch.block_table, rows, plens, router, layer, spec)
    d = z[..., 1] - z[..., 0]
    m = float((-d[d < 0]).median())  # half of the SA heads flip
    for margin in (0.0, m, -m):
        e = _epilogue(torch.zeros(R, dtype=torch.int8), torch.zeros(R, dtype=torch.bool), rows.clone(), rows,
                      thresholds(0.0, margin).expand(R).contiguous(), torch.zeros(L, hkv, dtype=torch.int8), L, R,
                      R, False)  # fmt: skip
        table = torch.full((R, L, hkv), 9, dtype=torch.int8)
        route(
            batch.key_cache, batch.block_table, rows, plens, rows, pack_router_weights(router), layer, table,
            inv_freq=spec.inv_freq, attention_scaling=spec.attention_scaling, epilogue=e, sa_margin=margin,
        )  # fmt: skip
        want = decide(z, margin)
        sure = (d + margin).abs() > 10 * LOGIT_ATOL
        assert torch.equal((table[:, layer] == 0)[sure], want[sure])
        assert torch.equal(e.tables.fa[:, layer][sure], want[sure])
        assert torch.equal((e.tables.step_modes[layer] == 0)[sure], want[sure])
    assert decide(z, m).sum() > decide(z, 0.0).sum() > decide(z, -m).sum()


@pytest.mark.parametrize("bad", [True, float("nan"), float("inf"), "1"])
def test_route_sa_margin_must_be_a_finite_number(bad):
    batch, spec, router, rows, plens = make_case([120, 80])
    table = torch.zeros(2, 3, batch.key_cache.shape[2], dtype=torch.int8)
    with pytest.raises(ValueError, match="sa_margin: must be a finite number"):
        route(
            batch.key_cache, batch.block_table, rows, plens, rows, pack_router_weights(router), 0, table,
            inv_freq=spec.inv_freq, sa_margin=bad,
        )  # fmt: skip
