"""Unit tests of the backend's pieces, without an engine: attention ops against the reference, the
pre-RoPE key recovery against vLLM's own RoPE, per-request planning as both model runners build
metadata (V2 passes req_idx, V1 does not), TP head mapping, overrides, registration."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from elastic_vllm.config import ConfigError, HeadMode
from elastic_vllm.ops.xattn_select.naive import xattn_block_mask_ref
from elastic_vllm.reference.attention import hybrid_attention_ref
from elastic_vllm.reference.paged import make_paged_batch
from elastic_vllm.reference.rope import RopeSpec, apply_rope
from elastic_vllm.router.checkpoint import RouterCheckpointError
from elastic_vllm.router.model import ElasticRouter, decide, pool_keys
from elastic_vllm.vllm_plugin import observe
from elastic_vllm.vllm_plugin.ops import AttnParams, resolve_ops, torch_attention
from elastic_vllm.vllm_plugin.overrides import effective_force, request_override
from elastic_vllm.vllm_plugin.parallel import global_kv_heads
from elastic_vllm.vllm_plugin.routing import RouteRow, build_route_batch, decode_modes, route_layer
from elastic_vllm.vllm_plugin.state import EngineState

from .routers import head_selecting_rules, linear_router, prompt_splitting_rule, save_test_router

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)

SCENARIOS = {
    "pure_prefill": ([37, 113], [37, 113]),
    "chunked_prefill": ([70, 190], [20, 77]),
    "pure_decode": ([5, 64, 129], [1, 1, 1]),
    "mixed": ([100, 17, 60, 1], [1, 17, 12, 1]),
}


def _strided(cache_k: torch.Tensor, cache_v: torch.Tensor):
    """The views vLLM hands the backend: K and V halves of one [nb, bs, H, 2D] tensor."""
    D = cache_k.shape[-1]
    both = torch.cat([cache_k, cache_v], dim=-1)
    return both[..., :D], both[..., D:]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("modes_kind", ["fa", "ssa", "mixed", "xa"])
def test_torch_attention_matches_reference(scenario, modes_kind):
    seq_lens, q_lens = SCENARIOS[scenario]
    g = torch.Generator().manual_seed(1)
    batch = make_paged_batch(seq_lens, q_lens, 8, 2, 64, block_size=16, generator=g)
    B = len(seq_lens)
    choices = {"fa": [FA], "ssa": [SSA], "mixed": [FA, SSA], "xa": [FA, SSA, XA]}[modes_kind]
    modes = torch.tensor(choices * 4, dtype=torch.int32)[torch.randperm(len(choices) * 4, generator=g)][: 2 * B]
    modes = modes.view(B, 2) if modes.numel() == 2 * B else torch.full((B, 2), choices[-1], dtype=torch.int32)
    p = AttnParams(scale=0.125, sink=4, window=24, xattn_stride=4, xattn_block=16, xattn_threshold=0.8)
    kc, vc = _strided(batch.key_cache, batch.value_cache)
    out = torch.full_like(batch.q, float("nan"))
    qsl = batch.query_start_loc.tolist()
    torch_attention(batch.q, kc, vc, batch.block_table, qsl, seq_lens, modes, p, out)
    xa_masks = []
    for b in range(B):
        s, e = qsl[b], qsl[b + 1]
        masks = [
            xattn_block_mask_ref(
                batch.q[s:e, h * 4 : (h + 1) * 4], batch.keys[b][:, h], seq_lens[b] - (e - s), 4, 16, 0.8, 0.125
            )
            for h in range(2)
        ]
        xa_masks.append(torch.stack(masks))
    want = hybrid_attention_ref(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        modes, sink=4, window=24, scale=0.125, xa_block_masks=xa_masks, xa_block=16,
    )  # fmt: skip
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


def test_decode_modes():
    m = torch.tensor([FA, SSA, XA], dtype=torch.int8)
    assert decode_modes(m, "dense").tolist() == [FA, FA, FA]
    assert decode_modes(m, "sparse").tolist() == [FA, SSA, FA]


def test_route_batch_host_flags_skip_only_no_op_glue():
    """The per-layer glue skips the force / decode-phase ops when no row needs them (host facts of the
    batch); with them present it applies them, and the skipping path gives the same decisions."""
    from elastic_vllm.config import ElasticConfig

    batch = make_paged_batch([40, 30], [40, 30], 4, 2, 16, block_size=16, generator=torch.Generator().manual_seed(2))
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rope = RopeSpec(inv, 1.0, 16, 16)
    torch.manual_seed(0)
    router = ElasticRouter(2, 16)
    cfg = ElasticConfig()
    auto = [RouteRow(0, 40, "auto", False, 3), RouteRow(1, 30, "auto", False, None)]
    rb = build_route_batch(auto, batch.block_table, 16, "boundary", 100)
    assert (rb.any_forced, rb.any_decode_phase) == (False, False)
    assert rb.rows_i32.dtype == torch.int32 and rb.rows_i32.tolist() == [0, 1]
    forced = [RouteRow(0, 40, "all-SA", True, 3), RouteRow(1, 30, "auto", False, None)]
    rbf = build_route_batch(forced, batch.block_table, 16, "boundary", 100)
    assert (rbf.any_forced, rbf.any_decode_phase) == (True, True)
    _, (fa, modes, _), _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2)
    _, (fa_f, _, _), _ = route_layer(1, batch.key_cache, rbf, router, rope, cfg, 2)
    assert not fa_f[0].any() and torch.equal(fa_f[1], fa[1])  # forced row all SA, the auto row unchanged
    rb.any_forced = True  # the full path on the same auto rows: same decisions
    _, (fa_full, modes_full, _), _ = route_layer(1, batch.key_cache, rb, router, rope, cfg, 2)
    assert torch.equal(fa_full, fa) and torch.equal(modes_full, modes)


def test_prerope_keys_invert_vllms_own_rope():
    """Keys rotated by vLLM's RotaryEmbedding (llama3 scaling) come back exactly."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192,
    )  # fmt: skip
    cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_parameters=params
    )
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 131072, True, dict(params), dtype=torch.float32)
    x = torch.randn(64, 2, 64)
    pos = torch.randint(0, 120_000, (64,))
    _, k = rope.forward_native(pos, torch.randn(64, 256), x.reshape(64, -1).clone())
    from elastic_vllm.reference.rope import invert_rope

    torch.testing.assert_close(
        invert_rope(k.view(64, 2, 64), pos, RopeSpec.from_hf_config(cfg)), x, atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "tp,kv,want",
    [
        (1, 3, [[0, 1, 2]]),
        (2, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (4, 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (4, 2, [[0], [0], [1], [1]]),  # replicated: 2 ranks per KV head
        (8, 8, [[i] for i in range(8)]),
    ],
)
def test_global_kv_heads(tp, kv, want):
    assert [global_kv_heads(r, tp, kv) for r in range(tp)] == want


def test_request_override():
    assert request_override(None) == "auto" and request_override({"other": 1}) == "auto"
    assert request_override({"elastic_force": "all-SA"}) == "all-SA"
    with pytest.raises(ValueError, match=r"vllm_xargs.elastic_force: must be one of 'auto', 'all-FA', 'all-SA'"):
        request_override({"elastic_force": "all-sa"})
    assert effective_force("auto", "all-FA") == "all-FA" and effective_force("all-SA", "all-FA") == "all-SA"


@pytest.fixture
def serving_elastic():
    """This process as an API server serving the elastic backend: the admission checks of the plugin run."""
    from elastic_vllm.vllm_plugin import compat, plugin

    plugin.register()
    config = SimpleNamespace(additional_config={"elastic": {}}, attention_config=SimpleNamespace(backend="elastic"))
    before, compat._SERVING_ELASTIC[0] = compat._SERVING_ELASTIC[0], config
    try:
        yield config
    finally:
        compat._SERVING_ELASTIC[0] = before


def test_refused_request_names_the_field_of_its_endpoint(serving_elastic):
    """The same check names vllm_xargs.<key> for the OpenAI-compatible endpoints and sampling_params.extra_args.<key>
    for the token endpoint (/inference/v1/generate, whose JSON carries the SamplingParams themselves)."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "extra_args": {"elastic_force": "fast"}}}
    with pytest.raises(VLLMValidationError) as e:
        GenerateRequest.model_validate(body)
    assert str(e.value).startswith("sampling_params.extra_args.elastic_force: must be one of 'auto'"), e.value
    assert e.value.parameter == "sampling_params.extra_args"
    body["sampling_params"]["extra_args"] = {"elasticforce": "all-SA"}
    with pytest.raises(VLLMValidationError, match=r"^sampling_params.extra_args.elasticforce: not an elastic-vllm key"):
        GenerateRequest.model_validate(body)
    with pytest.raises(VLLMValidationError) as e:  # vllm_xargs of the OpenAI endpoints become extra_args this way
        SamplingParams.from_optional(max_tokens=2, extra_args={"elastic_force": "fast"})
    assert str(e.value).startswith("vllm_xargs.elastic_force: must be one of"), e.value
    assert e.value.parameter == "vllm_xargs"
    assert GenerateRequest.model_validate({**body, "sampling_params": {"extra_args": {"elastic_force": "all-SA"}}})


def test_request_field_reads_the_token_endpoints_handler_from_the_stack():
    """At engine admission the SamplingParams are built already: the token endpoint's handler (a module of vLLM's
    token_in_token_out package) on the stack names its field."""
    from elastic_vllm.vllm_plugin import compat

    code = compile(
        "def handler(f):\n    return f()\n", "/x/vllm/entrypoints/scale_out/token_in_token_out/serving.py", "exec"
    )
    scope: dict = {}
    exec(code, scope)
    assert scope["handler"](compat.request_field) == compat.TOKENS_FIELD
    assert (lambda: compat.request_field())() == compat.XARGS_FIELD


def test_register_is_idempotent_and_spawn_safe():
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from elastic_vllm.vllm_plugin import plugin

    plugin.register()
    plugin.register()
    custom = AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum["ELASTIC"] is custom
    assert custom.get_path() == plugin.BACKEND_PATH
    assert "ELASTIC" not in [m.name for m in AttentionBackendEnum]  # an alias, not a new member
    assert pickle.loads(pickle.dumps(custom)) is custom  # pickles as CUSTOM (spawned engines unpickle it)
    from vllm.config.attention import AttentionConfig

    assert AttentionConfig.validate_backend_before("elastic") is custom
    sel = SimpleNamespace(use_mla=False, use_sparse=False)
    assert current_platform.get_attn_backend_cls(custom, sel) == plugin.BACKEND_PATH
    cpu = AttentionBackendEnum.CPU_ATTN
    assert current_platform.get_attn_backend_cls(cpu, sel) == cpu.get_path()


# --- per-request planning, as the two model runners drive it ------------------------------------
L, HKV, HQ, D, BS = 2, 2, 4, 64, 16


class _Config(SimpleNamespace):  # weak-referenceable, as VllmConfig is
    pass


def fake_vllm_config(additional: dict, use_v2: bool = False):
    hf = LlamaConfig(
        hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
        num_hidden_layers=L, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    mc = SimpleNamespace(hf_config=hf, served_model_name="tiny", model="tiny", get_num_kv_heads=lambda pc: HKV)
    return _Config(
        additional_config=additional,
        model_config=mc,
        parallel_config=SimpleNamespace(),
        device_config=SimpleNamespace(device="cpu"),
        speculative_config=None,
        use_v2_model_runner=use_v2,
    )


@dataclass
class NewReq:
    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    sampling_params: object = None


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set = field(default_factory=set)


@dataclass
class SchedOut:
    scheduled_new_reqs: list
    scheduled_cached_reqs: Cached
    num_scheduled_tokens: dict
    finished_req_ids: set = field(default_factory=set)
    preempted_req_ids: set | None = None


class PagedSim:
    """Requests with known pre-RoPE keys, written post-RoPE into per-layer paged caches."""

    def __init__(self, lens: dict[str, int], rope: RopeSpec, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rope = rope
        self.pre = {r: [torch.randn(n, HKV, D, generator=g) + 2 * li for li in range(L)] for r, n in lens.items()}
        nblk = {r: (n + BS - 1) // BS for r, n in lens.items()}
        total = sum(nblk.values()) + 2
        perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
        self.blocks, at = {}, 0
        for r, n in nblk.items():
            self.blocks[r] = perm[at : at + n]
            at += n
        self.phys = [torch.zeros(total, BS, HKV, 2 * D) for _ in range(L)]  # [nb, bs, H, 2D] (NHD)
        for r, n in lens.items():
            pos = torch.arange(n)
            for li in range(L):
                k = apply_rope(self.pre[r][li], pos, rope)
                blk = torch.tensor(self.blocks[r])[pos // BS]
                self.phys[li][blk, pos % BS, :, :D] = k
        self.max_blocks = max(nblk.values())

    def key_cache(self, layer: int):
        from elastic_vllm.vllm_plugin import compat

        return compat.split_kv_cache(self.phys[layer].transpose(1, 2), D)[0]

    def common(self, rows: list[str | None], q_lens: list[int], seq_lens: list[int], req_idx=None):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        B = len(rows)
        bt = torch.zeros(B, self.max_blocks, dtype=torch.int32)
        for b, r in enumerate(rows):
            if r is not None:
                bt[b, : len(self.blocks[r])] = torch.tensor(self.blocks[r])
        qsl = torch.zeros(B + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
        kw = {"req_idx": np.array(req_idx)} if req_idx is not None else {}
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=B, num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            block_table_tensor=bt, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long), **kw,
        )  # fmt: skip


def run_step(state, sim, so, rows, q_lens, seq_lens, req_idx=None):
    state.on_step_begin(so)
    state.on_rows([r for r in rows])
    plan = state.plan_step(sim.common(rows, q_lens, seq_lens, req_idx))
    if plan.route is not None:
        for li in range(L):
            state.route(li, sim.key_cache(li), plan.route)
    modes = state.row_modes[:, : len(rows)].clone()  # [L, B, H]
    state.on_step_end()
    state.on_step_output()()  # what the runner hook calls once the step's output is read
    return plan, modes


def router_decisions(router, keys_per_layer, end, n):
    pooled = torch.stack([pool_keys(k[:end], "boundary", n) for k in keys_per_layer])
    logits = torch.stack([router(li, pooled[li]) for li in range(L)])
    return logits, decide(logits)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("chunk_routing", ["prefix", "dense"])
def test_per_request_routing_lifecycle(tmp_path, runner, chunk_routing):
    """Two requests, chunked prefill, as V1 (no req_idx, rows re-ordered) and V2 (req_idx) build metadata."""
    torch.manual_seed(0)
    lens = {"A": 300, "B": 40}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope)
    # layer 0 splits A (FA) from B (SA) at head 0; layer 1 is a random router layer
    pa = pool_keys(sim.pre["A"][0][:300], "boundary", 8)[0]
    pb = pool_keys(sim.pre["B"][0][:40], "boundary", 8)[0]
    r = linear_router(L, D, {0: prompt_splitting_rule(pa, pb)})
    r.layers[1] = ElasticRouter(L, D).layers[1]
    path = save_test_router(r, tmp_path / "r", HKV)
    cfg = {
        "elastic": {"router_path": str(path), "pool_tokens": 8, "chunk_routing": chunk_routing, "sink": 4, "window": 32}
    }
    st = EngineState(fake_vllm_config(cfg, use_v2=runner == "v2"))
    st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    observe.clear()
    v2 = runner == "v2"

    # step 1: A's first chunk (100 of 300), B whole (40): B final, A prefix-routed (or dense)
    so = SchedOut([NewReq("A", [0] * 300), NewReq("B", [0] * 40)], Cached(), {"A": 100, "B": 40})
    plan, modes = run_step(st, sim, so, ["A", "B"], [100, 40], [100, 40], req_idx=[2, 0] if v2 else None)
    routed = {rr.row: rr for rr in plan.route.host}
    assert routed[1].final_slot is not None and routed[1].end == 40
    _, dec_b = router_decisions(r, sim.pre["B"], 40, 8)
    if chunk_routing == "prefix":
        assert routed[0].final_slot is None and routed[0].end == 100  # prefix [0, 100)
        _, dec_a_prefix = router_decisions(r, sim.pre["A"], 100, 8)
        want = torch.where(dec_a_prefix, FA, SSA)
        assert torch.equal(modes[:, 0].long(), want.long())
    else:
        assert 0 not in routed and (modes[:, 0] == FA).all()  # dense chunk
    assert torch.equal(modes[:, 1].long(), torch.where(dec_b, FA, SSA).long())
    ev = observe.events()
    assert [e.req_id for e in ev] == ["B"] and torch.equal(ev[0].decisions, dec_b)
    assert not ev[0].decisions[0, 0] and ev[0].prompt_len == 40

    # step 2: V1 puts B's decode row first; A completes its prompt (200 more) -> final over [0, 300)
    so = SchedOut([], Cached(["B", "A"], [40, 100]), {"B": 1, "A": 200})
    plan, modes = run_step(st, sim, so, ["B", "A"], [1, 200], [41, 300], req_idx=[0, 2] if v2 else None)
    assert [rr.row for rr in plan.route.host] == [1]
    logits_a, dec_a = router_decisions(r, sim.pre["A"], 300, 8)
    assert torch.equal(modes[:, 1].long(), torch.where(dec_a, FA, SSA).long())
    assert (modes[:, 0] == FA).all()  # B decodes densely (decode_mode dense)
    ev = observe.events("A")
    assert len(ev) == 1 and torch.equal(ev[0].decisions, dec_a) and ev[0].decisions[0, 0]
    torch.testing.assert_close(ev[0].logits, logits_a, atol=1e-4, rtol=1e-5)
    assert ev[0].omega_msr == pytest.approx(float((~dec_a).float().mean()))

    # step 3: both decode; A's table row is reused, not re-routed; B finishes after this step
    so = SchedOut([], Cached(["A", "B"], [300, 41]), {"A": 1, "B": 1})
    plan, modes = run_step(st, sim, so, ["A", "B"], [1, 1], [301, 42], req_idx=[2, 0] if v2 else None)
    assert plan.route is None and (modes == FA).all()
    assert len(observe.events()) == 2  # once per request

    # step 4: B finished (freed); a padded dummy row reads the reserved all-FA slot
    so = SchedOut([], Cached(["A"], [301]), {"A": 1}, finished_req_ids={"B"})
    plan, modes = run_step(st, sim, so, ["A", None], [1, 1], [302, 1], req_idx=[2, 3] if v2 else None)
    assert st.live_request_ids() == ["A"] and (modes == FA).all()


def test_vllm_warmup_requests_are_routed_but_not_recorded(tmp_path):
    """vLLM 0.26's V2 runner warms up through execute_model with requests '_warmup_{i}_' (2-token prompts):
    they are routed like any request, but no routing event / metric is recorded for them."""
    from elastic_vllm.vllm_plugin.requests import is_vllm_warmup_request

    assert is_vllm_warmup_request("_warmup_0_") and is_vllm_warmup_request("_warmup_12_")
    assert is_vllm_warmup_request("_v2_mixed_warmup_decode_") and is_vllm_warmup_request("_v2_mixed_warmup_prefill_")
    for rid in ("0", "cmpl-1", "_warmup_x_", "_warmup_1", "x_warmup_1_", "_warmup_1_tail"):
        assert not is_vllm_warmup_request(rid), rid
    lens = {"_warmup_0_": 2, "_warmup_1_": 2, "A": 40}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope, seed=4)
    torch.manual_seed(4)
    path = save_test_router(ElasticRouter(L, D), tmp_path / "r", HKV)
    st = EngineState(fake_vllm_config({"elastic": {"router_path": str(path), "pool_tokens": 8}}, use_v2=True))
    st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    observe.clear()
    before = observe.COUNTERS.warmup_routings
    rows = ["_warmup_0_", "_warmup_1_", "A"]
    so = SchedOut([NewReq(r, [0] * lens[r]) for r in rows], Cached(), dict(lens))
    plan, _ = run_step(st, sim, so, rows, [2, 2, 40], [2, 2, 40], req_idx=[0, 1, 2])
    assert sorted(rr.row for rr in plan.route.host) == [0, 1, 2]  # all three routed
    assert [e.req_id for e in observe.events()] == ["A"]
    assert observe.COUNTERS.warmup_routings - before == 2
    so = SchedOut([], Cached(), {}, finished_req_ids={"_warmup_0_", "_warmup_1_"})
    st.on_step_begin(so)
    st.on_step_end()
    st.on_step_output()()
    assert st.live_request_ids() == ["A"]


def test_decode_sparse_and_readmission_reroutes_identically(tmp_path):
    lens = {"A": 120}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope, seed=3)
    torch.manual_seed(3)
    path = save_test_router(ElasticRouter(L, D), tmp_path / "r", HKV)
    st = EngineState(fake_vllm_config({"elastic": {"router_path": str(path), "decode_mode": "sparse"}}))
    st.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    observe.clear()
    before = observe.COUNTERS.snapshot()
    run_step(st, sim, SchedOut([NewReq("A", [0] * 100)], Cached(), {"A": 100}), ["A"], [100], [100])
    final = observe.events("A")[0].head_modes
    _, modes = run_step(st, sim, SchedOut([], Cached(["A"], [100]), {"A": 1}), ["A"], [1], [101])
    assert torch.equal(modes[:, 0].to(torch.int8), decode_modes(final, "sparse"))
    # preempted, re-admitted: recomputes prompt + output (101 tokens) in one chunk past the prompt end
    run_step(st, sim, SchedOut([], Cached(), {}, preempted_req_ids={"A"}), [], [1], [1])
    so = SchedOut([], Cached(["A"], [0], resumed_req_ids={"A"}), {"A": 101})
    plan, _ = run_step(st, sim, so, ["A"], [101], [101])
    assert plan.route.host[0].end == 100 and plan.route.host[0].final_slot is not None
    after = observe.COUNTERS.snapshot()
    assert after["rerouted"] == before["rerouted"] + 1 and after["reroute_mismatches"] == before["reroute_mismatches"]
    assert len(observe.events("A")) == 1  # recorded once


class _RankSim:
    """A PagedSim seen by one TP rank: the paged caches hold its KV heads only."""

    def __init__(self, sim: PagedSim, heads: list[int]):
        self.sim, self.h0, self.n = sim, heads[0], len(heads)

    def common(self, *args, **kwargs):
        return self.sim.common(*args, **kwargs)

    def key_cache(self, layer: int):
        return self.sim.key_cache(layer)[:, :, self.h0 : self.h0 + self.n]


def two_requests_split_router(tmp_path):
    """Requests A (300 tokens) and B (40) in a PagedSim, and the config of a router that splits them: layer 0
    routes A to FA and B to SA, layer 1 routes head 0 FA and head 1 SA (so ranks' own shares differ)."""
    torch.manual_seed(0)
    lens = {"A": 300, "B": 40}
    rope = RopeSpec.from_hf_config(fake_vllm_config({}).model_config.hf_config)
    sim = PagedSim(lens, rope)
    pooled = torch.stack([torch.stack([pool_keys(k[:n], "boundary", 8) for k in sim.pre[q]]) for q, n in lens.items()])
    rules = {0: prompt_splitting_rule(pooled[0, 0, 0], pooled[1, 0, 0]), 1: head_selecting_rules(pooled, [(1, 0)])[1]}
    path = save_test_router(linear_router(L, D, rules), tmp_path / "r", HKV)
    return sim, {"elastic": {"router_path": str(path), "pool_tokens": 8, "sink": 4, "window": 32}}


@pytest.mark.parametrize(
    "tp,kv",
    [(2, [(0, 0), (1, 1)]), (4, [(0, 0), (0, 0), (1, 1), (1, 1)])],  # (first, last) head; tp 4: 2 replicas per head
    ids=["tp2", "tp4-replicated"],
)
def test_tensor_parallel_omegas_count_every_head_once(tmp_path, monkeypatch, tp, kv):
    """TP ranks (threads here; a barrier stands in for vLLM's TP-group all-gather) route their own KV heads
    and record Omegas over every head once, replicas once: equal to TP=1's; head decisions are counted by
    the first replica of each head only; TP=1 never gathers."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client import REGISTRY

    from elastic_vllm.vllm_plugin import compat

    sim, cfg = two_requests_split_router(tmp_path)
    rank = threading.local()
    contributions: list = [None] * tp
    barrier = threading.Barrier(tp, timeout=60)
    calls = []

    def all_gather(obj):
        calls.append(rank.r)
        contributions[rank.r] = obj
        barrier.wait()
        out = list(contributions)
        barrier.wait()
        return out

    monkeypatch.setattr(compat, "tp_all_gather_object", all_gather)

    def step(state, view):
        so = SchedOut([NewReq("A", [0] * 300), NewReq("B", [0] * 40)], Cached(), {"A": 300, "B": 40})
        run_step(state, view, so, ["A", "B"], [300, 40], [300, 40])

    observe.clear()
    single = EngineState(fake_vllm_config(cfg))
    single.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
    step(single, sim)
    assert calls == []  # TP=1: no collective
    want = {e.req_id: e for e in observe.events()}
    assert all(e.omega_msr_all == e.omega_msr for e in want.values())

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0

    def decisions_total():
        return sum(
            sample("elastic:head_decisions_total", layer=str(li), decision=d, tp_rank=str(t))
            for li in range(L)
            for d in ("FA", "SA")
            for t in range(tp)
        )

    msr_n, msr_sum, esr_sum = (sample(f"elastic:request_omega_{m}") for m in ("msr_count", "msr_sum", "esr_sum"))
    heads_before = decisions_total()
    observe.clear()

    def run_rank(r_):
        rank.r = r_
        monkeypatch.setattr(compat, "tp_rank_and_size", lambda: (rank.r, tp))
        vc = fake_vllm_config(cfg)
        vc.model_config.get_num_kv_heads = lambda pc: max(1, HKV // tp)
        state = EngineState(vc)
        state.attach(torch.device("cpu"), max_rows=4, max_slots=4, block_size=BS)
        step(state, _RankSim(sim, list(state.kv_heads)))

    with ThreadPoolExecutor(tp) as pool:
        for f in [pool.submit(run_rank, r_) for r_ in range(tp)]:
            f.result()
    assert sorted(calls) == list(range(tp))  # one gather per rank: both routings final on one step
    local_msr = set()
    for e in observe.events():
        first, last = kv[e.tp_rank]
        assert e.kv_heads == tuple(range(first, last + 1))
        w = want[e.req_id]
        assert torch.equal(e.decisions, w.decisions[:, first : last + 1])
        assert e.omega_msr_all == pytest.approx(w.omega_msr, abs=1e-12)
        assert e.omega_esr_all == pytest.approx(w.omega_esr, abs=1e-12)
        assert e.counts_heads == (e.tp_rank == 0 or kv[e.tp_rank] != kv[e.tp_rank - 1])
        local_msr.add((e.req_id, e.omega_msr))
    assert len(observe.events()) == 2 * tp
    assert len(local_msr) > len(want)  # ranks' own shares differ: rank 0's alone would be wrong
    # rank 0 records the per-request histograms once, over all heads; every (layer, head) counted once
    assert sample("elastic:request_omega_msr_count") == msr_n + 2
    assert sample("elastic:request_omega_msr_sum") == pytest.approx(msr_sum + sum(e.omega_msr for e in want.values()))
    assert sample("elastic:request_omega_esr_sum") == pytest.approx(esr_sum + sum(e.omega_esr for e in want.values()))
    assert decisions_total() == heads_before + 2 * L * HKV


def test_global_omegas_dedupes_replicas():
    from elastic_vllm.vllm_plugin.parallel import HeadCounts, global_omegas, is_first_replica

    # 4 ranks, 2 KV heads x 3 layers, each head on 2 ranks; request "a": head 0 all FA, head 1 all SA
    a0, a1 = HeadCounts((0,), 3, 3, 0.0), HeadCounts((1,), 3, 0, 3 * 0.9)
    per_rank = [{"a": a0}, {"a": a0}, {"a": a1}, {"a": a1}]
    assert global_omegas(per_rank) == {"a": (0.5, pytest.approx(0.45))}
    assert global_omegas([{"a": a0}]) == {"a": (0.0, 0.0)}  # one rank: its own heads
    assert [is_first_replica(r, 4, 2) for r in range(4)] == [True, False, True, False]
    assert all(is_first_replica(r, 2, 8) for r in range(2))
    # unequal shards weigh by head count; requests missing on a rank use the ranks that have them
    b = global_omegas([{"x": HeadCounts((0, 1), 4, 1, 0.0), "y": a0}, {"x": HeadCounts((2,), 2, 2, 0.0)}])
    assert b["x"] == (0.5, 0.0) and b["y"] == (0.0, 0.0)
    # pipeline stages hold different layers: the same KV heads on two stages are two sets of heads, not replicas
    s0, s1 = HeadCounts((0,), 3, 3, 0.0, stage=0), HeadCounts((0,), 3, 0, 3 * 0.9, stage=1)
    assert global_omegas([{"a": s0}, {"a": s1}]) == {"a": (0.5, pytest.approx(0.45))}


def test_startup_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_VLLM_ROUTER_WEIGHTS", str(tmp_path / "none"))
    monkeypatch.chdir(tmp_path)
    import elastic_vllm.router.discovery as state_mod

    monkeypatch.setattr(state_mod, "router_search_dirs", lambda: [tmp_path / "none"])
    with pytest.raises(ConfigError, match=r"no router for tiny .*router_path.*force"):
        EngineState(fake_vllm_config({}))
    with pytest.raises(ConfigError, match=r"elastic\.window"):
        EngineState(fake_vllm_config({"elastic": {"window": 0}}))
    other = save_test_router(ElasticRouter(L + 1, D), tmp_path / "other", HKV)
    with pytest.raises(RouterCheckpointError, match=r"num_layers: router 3 vs model 2"):
        EngineState(fake_vllm_config({"elastic": {"router_path": str(other)}}))
    # a shipped router whose backbone matches is found without router_path
    shipped = tmp_path / "none" / "tiny-router"
    save_test_router(ElasticRouter(L, D), shipped, HKV, "tiny")
    assert EngineState(fake_vllm_config({})).router_path == str(shipped)
    with pytest.raises(ValueError, match="elastic_ops"):
        resolve_ops("cuda", torch.device("cpu"))


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


def test_the_default_shipped_router_is_found_beside_the_alternatives(monkeypatch):
    """The real router_weights/: SmolLM2's default is found by shape, the sparser alternative (same shape, same
    backbone id) is not a second match, and it still loads as a router for that backbone."""
    from pathlib import Path

    import elastic_vllm.router.discovery as state_mod
    from elastic_vllm.router.checkpoint import load_router, read_meta

    root = Path(__file__).resolve().parents[2] / "router_weights"
    monkeypatch.setattr(state_mod, "router_search_dirs", lambda: [root])
    default, alt = root / "smollm2-135m-instruct", root / "alternatives" / "smollm2-135m-instruct-s040"
    shape = read_meta(default).shape
    assert read_meta(alt).shape == shape and read_meta(alt).backbone.id == read_meta(default).backbone.id
    assert state_mod.find_shipped_router(shape, "/models/SmolLM2-135M-Instruct") == default
    assert load_router(alt).meta.training["targets"]["sensitive"] == 0.4
    # the same two folders side by side would be ambiguous: the search says so instead of picking one
    monkeypatch.setattr(state_mod, "router_search_dirs", lambda: [root, root / "alternatives"])
    with pytest.raises(ConfigError, match="several shipped routers match"):
        state_mod.find_shipped_router(shape, "/models/SmolLM2-135M-Instruct")


# --- runner hooks, on stand-ins with the signatures of vLLM 0.26 and 0.32 -------------------------
class _Obs:
    def __init__(self, eager: bool):
        self.eager, self.rows, self.steps = eager, [], 0
        self.outputs_launched, self.outputs_read = 0, []

    def on_step_begin(self, so):
        self.steps += 1

    def on_rows(self, req_ids):
        self.rows.append(req_ids)

    def on_step_end(self, failed=False):
        pass

    def on_step_output(self):
        self.outputs_launched += 1
        return lambda: self.outputs_read.append(self.steps)

    def needs_eager_attention(self):
        return self.eager


def _fake_v2_module(version: str):
    import types

    mod = types.ModuleType(f"fake_v2_{version}")
    if version == "0.26":

        def dispatch_cg_and_sync_dp(
            cudagraph_manager,
            num_reqs,
            num_tokens,
            uniform_token_count,
            dp_size,
            dp_rank,
            need_eager=False,
            num_active_loras=0,
        ):
            return {"uniform_token_count": uniform_token_count}
    else:

        def dispatch_cg_and_sync_dp(
            cudagraph_manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank, max_query_len=None,
            need_eager=False, num_active_loras=0, parallel_config=None, allow_ubatching=False, uniform_decode=False,
            dp_sync_state=None,
        ):  # fmt: skip
            return {
                "uniform_token_count": uniform_token_count,
                "uniform_decode": uniform_decode,
                "max_query_len": max_query_len,
            }

    class GPUModelRunner:
        vllm_config = None

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            kw = {"uniform_decode": True, "max_query_len": 1} if version != "0.26" else {}
            self.desc = mod.dispatch_cg_and_sync_dp(None, 2, 2, 1, 1, 0, **kw)
            self.batch = self.prepare_inputs(scheduler_output, None)
            return "out"

        def prepare_inputs(self, scheduler_output, batch_desc):
            return SimpleNamespace(req_ids=["a", "b", None], num_reqs=2)

        def sample_tokens(self, grammar_output):
            return SimpleNamespace(get_output=lambda: "output")  # async scheduling: an AsyncOutput

    mod.GPUModelRunner = GPUModelRunner
    mod.dispatch_cg_and_sync_dp = dispatch_cg_and_sync_dp
    return mod


@pytest.mark.parametrize("version", ["0.26", "0.32"])
@pytest.mark.parametrize("eager", [False, True])
def test_v2_runner_hooks(version, eager):
    from elastic_vllm.vllm_plugin import compat

    mod = _fake_v2_module(version)
    assert compat._install_v2(mod) == []
    obs = _Obs(eager)
    saved = compat._observer_for
    compat._observer_for = lambda runner: obs
    try:
        runner = mod.GPUModelRunner()
        assert runner.execute_model(object()) == "out"
        desc = runner.desc
        assert runner.execute_model(object(), None, True) == "out"  # dummy runs are not steps
        out = runner.sample_tokens(None)
        assert obs.outputs_launched == 1 and obs.outputs_read == []  # the forward may still be running
        assert out.get_output() == "output" and obs.outputs_read == [1]  # recorded once it is read
    finally:
        compat._observer_for = saved
    assert obs.steps == 1 and obs.rows == [["a", "b"]]
    if eager:  # a step that routes never gets a uniform-decode (FULL graph) descriptor
        assert desc["uniform_token_count"] is None and desc.get("uniform_decode", False) is False
    else:
        assert desc["uniform_token_count"] == 1


def test_v1_runner_hooks():
    import types

    from elastic_vllm.vllm_plugin import compat

    mod = types.ModuleType("fake_v1")

    class GPUModelRunner:
        input_batch = SimpleNamespace(req_ids=["r2", "r1", "stale"])

        def execute_model(self, scheduler_output, intermediate_tensors=None):
            self.disp = self._determine_batch_execution_and_padding(2, 2, None, 1)
            self._build_attention_metadata(num_tokens=2, num_reqs=2, max_query_len=1)
            return "out"

        def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, for_cudagraph_capture=False):
            return None

        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, nst, mnst, force_uniform_decode=None):
            return force_uniform_decode

        def sample_tokens(self, grammar_output):
            return "output"  # no async scheduling: a complete ModelRunnerOutput

    mod.GPUModelRunner = GPUModelRunner
    assert compat._install_v1(mod) == []
    obs = _Obs(eager=True)
    saved = compat._observer_for
    compat._observer_for = lambda runner: obs
    try:
        r = GPUModelRunner()
        assert r.execute_model(object()) == "out"
        r._build_attention_metadata(num_tokens=2, num_reqs=2, max_query_len=1)  # outside a step: not recorded
        assert r.sample_tokens(None) == "output" and obs.outputs_read == [1]  # complete: recorded at once
    finally:
        compat._observer_for = saved
    assert obs.rows == [["r2", "r1"]] and r.disp is False


@pytest.mark.parametrize(
    "device,ops,want",
    [("cuda", None, "UNIFORM_SINGLE_TOKEN_DECODE"), ("cuda", "torch", "NEVER"), ("cpu", None, "NEVER")],
)
def test_cudagraph_support_is_declared_per_ops(device, ops, want):
    """Triton ops: FULL graphs for single-token decode batches; PyTorch ops (host loops): never."""
    from elastic_vllm.vllm_plugin.backend import ElasticMetadataBuilder

    cfg = SimpleNamespace(
        additional_config={"elastic_ops": ops} if ops else {}, device_config=SimpleNamespace(device=device)
    )
    assert ElasticMetadataBuilder.get_cudagraph_support(cfg, None).name == want


def test_preferred_block_size_is_128_on_cuda_and_vllms_default_elsewhere(monkeypatch):
    """vLLM (0.26+) asks the backend for the block size when --block-size is not given."""
    from vllm.config.cache import CacheConfig

    from elastic_vllm.vllm_plugin import backend, compat

    B = backend.ElasticAttentionBackend
    default = CacheConfig.DEFAULT_BLOCK_SIZE
    assert not compat.on_cuda_platform()  # this machine: vLLM's CPU build
    assert B.get_preferred_block_size(default) == default
    monkeypatch.setattr(compat, "on_cuda_platform", lambda: True)
    assert B.get_preferred_block_size(16) == 128 and B.get_preferred_block_size(256) == 256
    assert B.supports_block_size(B.get_preferred_block_size(default))
