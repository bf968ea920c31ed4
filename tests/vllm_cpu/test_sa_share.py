"""Per-request fixed SA share (``vllm_xargs.elastic_sa_share``, benchmarks): the assignment, its
validation, and the engine state applying it (router still run, every chunk, Omega_MSR exact)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastic_vllm.config import HeadMode
from elastic_vllm.reference.rope import RopeSpec
from elastic_vllm.router.model import ElasticRouter
from elastic_vllm.vllm_plugin import observe
from elastic_vllm.vllm_plugin.overrides import request_sa_share, validate_sampling_params
from elastic_vllm.vllm_plugin.routing import fixed_share_fa
from elastic_vllm.vllm_plugin.state import EngineState

from .routers import save_test_router
from .test_units import BS, HKV, Cached, L, NewReq, PagedSim, SchedOut, fake_vllm_config, run_step


@pytest.mark.parametrize(
    "share, layers, heads", [(0.75, 32, 8), (0.5, 32, 8), (0.75, 36, 8), (0.5, 30, 3), (0.75, 30, 3), (0.3, 7, 5)]
)
def test_fixed_share_counts_and_rotation(share, layers, heads):
    fa = fixed_share_fa(share, layers, list(range(heads)), heads)
    assert fa.shape == (layers, heads)
    assert int((~fa).sum()) == int(share * heads * layers + 0.5)  # model-wide count exact
    per_layer = (~fa).sum(1)
    assert int(per_layer.max() - per_layer.min()) <= 1  # spread evenly over the layers
    if share == 0.75 and heads == 8:
        assert (per_layer == 6).all() and not fa[0, :6].any() and fa[0, 6:].all()
        assert not torch.equal(fa[0], fa[1])  # the SA heads rotate


def test_fixed_share_extremes_and_tensor_parallel_columns():
    assert fixed_share_fa(0.0, 4, range(8), 8).all()
    assert not fixed_share_fa(1.0, 4, range(8), 8).any()
    full = fixed_share_fa(0.75, 32, range(8), 8)
    halves = [fixed_share_fa(0.75, 32, range(r * 4, r * 4 + 4), 8) for r in range(2)]  # TP 2: heads 0-3, 4-7
    assert torch.equal(torch.cat(halves, dim=1), full)


def test_request_sa_share_validation():
    assert request_sa_share(None) is None and request_sa_share({"elastic_force": "all-FA"}) is None
    assert request_sa_share({"elastic_sa_share": 0.75}) == 0.75 and request_sa_share({"elastic_sa_share": 1}) == 1.0
    for bad in (1.5, -0.1, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match=r"vllm_xargs.elastic_sa_share: must be a number in \[0, 1\]"):
            request_sa_share({"elastic_sa_share": bad})
    with pytest.raises(ValueError, match=r"elastic_sa_share: cannot be combined with elastic_force='all-SA'"):
        request_sa_share({"elastic_sa_share": 0.5, "elastic_force": "all-SA"})
    with pytest.raises(ValueError, match="elastic_sa_share"):
        validate_sampling_params(SimpleNamespace(extra_args={"elastic_sa_share": 2}))
    validate_sampling_params(SimpleNamespace(extra_args={"elastic_sa_share": 0.5, "elastic_force": "auto"}))


@pytest.mark.parametrize("chunk_routing", ["prefix", "dense"])
def test_engine_state_applies_share_to_every_chunk_and_still_runs_the_router(tmp_path, chunk_routing):
    lens = {"A": 300, "B": 64}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope, seed=5)
    torch.manual_seed(5)
    path = save_test_router(ElasticRouter(L, 64), tmp_path / "r", HKV)
    cfg = {"elastic": {"router_path": str(path), "pool_tokens": 8, "chunk_routing": chunk_routing, "sink": 4}}
    st = EngineState(fake_vllm_config(cfg))
    st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    observe.clear()
    want = torch.where(fixed_share_fa(0.5, L, range(HKV), HKV), HeadMode.FA, HeadMode.SSA)  # [L, H]
    share = SimpleNamespace(extra_args={"elastic_sa_share": 0.5})
    # step 1: A's first chunk (share applied even with chunk_routing dense), B routed by the router
    so = SchedOut([NewReq("A", [0] * 300, sampling_params=share), NewReq("B", [0] * 64)], Cached(), {"A": 100, "B": 64})
    plan, modes = run_step(st, sim, so, ["A", "B"], [100, 64], [100, 64])
    assert {r.row: r.sa_share for r in plan.route.host} == {0: 0.5, 1: None}
    assert torch.equal(modes[:, 0].long(), want.long())
    # step 2: A completes its prompt: final routing = the fixed assignment; the router ran for it
    so = SchedOut([], Cached(["B", "A"], [64, 100]), {"B": 1, "A": 200})
    _, modes = run_step(st, sim, so, ["B", "A"], [1, 200], [65, 300])
    assert torch.equal(modes[:, 1].long(), want.long())
    ev = observe.events("A")[0]
    assert ev.omega_msr == 0.5 and torch.equal(ev.head_modes.long(), want.long())
    assert ev.logits.abs().sum() > 0  # router cost is part of the request, its decisions are replaced


def test_router_stays_float32_when_the_engine_builds_in_bf16(tmp_path):
    """vLLM constructs the model (and the backend state) with the model dtype as torch's default."""
    torch.manual_seed(1)
    saved = ElasticRouter(L, 64)
    path = save_test_router(saved, tmp_path / "r", HKV)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        st = EngineState(fake_vllm_config({"elastic": {"router_path": str(path)}}))
    finally:
        torch.set_default_dtype(before)
    assert torch.get_default_dtype() == before
    for (name, p), q in zip(st.router.named_parameters(), saved.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
