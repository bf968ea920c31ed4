"""Tiny random Llama (head_dim 64) and Qwen3 (head_dim 128, q/k norm) served by vLLM with the elastic
backend: all-FA equals CPU_ATTN, routing equals the transformers elastic reference, the Triton kernels
(under TRITON_INTERPRET) give the same results as the PyTorch path, preemption re-routes identically,
and a missing or mismatched router fails at startup with a message naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from elastic_vllm.router.model import ElasticRouter
from elastic_vllm.vllm_plugin import observe

from .conftest import KV_BYTES, close_llm, make_llm
from .helpers import compare_decisions, event_of, greedy, top_logprobs
from .hf_ref import HFElasticReference
from .routers import save_test_router
from .tiny_models import TINY, build_tiny_model

pytestmark = pytest.mark.slow

ENGINE = dict(
    max_num_batched_tokens=256, max_num_seqs=8, block_size=32, max_model_len=1024, kv_cache_memory_bytes=32 << 20
)
ELASTIC = {"sink": 2, "window": 8}
PROMPTS = [
    "Once upon a time, in a village by the sea, there lived an old fisherman who",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and",
    "Rain fell on the empty streets of the city while the clocks struck midnight and",
]
LOGPROB_ATOL = 1e-3  # float32 both ways; see test_engine.LOGPROB_ATOL
_CPU_ATTN: dict[str, list] = {}  # CPU_ATTN outputs (plugin installed), reused by the plugin-less comparison


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_model_dir):
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in TINY:
        model = build_tiny_model(kind, root / kind, demo_model_dir)
        head_dim = TINY[kind]["head_dim"]
        torch.manual_seed(1)
        router = save_test_router(
            ElasticRouter(2, head_dim), root / f"{kind}-router", TINY[kind]["num_key_value_heads"]
        )
        out[kind] = (model, router)
    return out


@pytest.mark.parametrize("kind", list(TINY))
def test_tiny_model_all_fa_matches_cpu_attn_and_routing_matches_transformers(tiny, kind):
    model, router = tiny[kind]
    llm = make_llm(
        model,
        attention_backend="elastic",
        additional_config={"elastic": {**ELASTIC, "router_path": str(router)}},
        **ENGINE,
    )
    try:
        fa = llm.generate(PROMPTS, greedy(6, logprobs=1, force="all-FA"), use_tqdm=False)
        auto = llm.generate(PROMPTS, greedy(2), use_tqdm=False)
    finally:
        close_llm(llm)
    ref = HFElasticReference(model, {**ELASTIC, "router_path": str(router)}, router)
    for o in auto:
        e = event_of(o.request_id)
        assert e.prompt_len > ELASTIC["window"] and e.decisions.shape == (2, TINY[kind]["num_key_value_heads"])
        compare_decisions(e, ref.route(o.prompt_token_ids)[0])
    before = observe.COUNTERS.snapshot()
    cpu = make_llm(model, attention_backend="CPU_ATTN", **ENGINE)
    try:
        theirs = cpu.generate(PROMPTS, greedy(6, logprobs=1), use_tqdm=False)
    finally:
        close_llm(cpu)
    assert observe.COUNTERS.snapshot() == before  # another backend selected: no elastic code ran
    _CPU_ATTN[kind] = [(o.outputs[0].token_ids, top_logprobs(o)) for o in theirs]
    for a, b in zip(fa, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(top_logprobs(a), top_logprobs(b))) <= LOGPROB_ATOL


def test_triton_kernels_path_equals_torch_path(tiny):
    """The GPU path (the kernels of elastic_vllm/ops: fused router, XAttention selection, hybrid prefill, split-KV decode),
    run by the CPU engine through Triton's interpreter, gives the torch path's routing and tokens.
    Mode XA-SSA with sparse decode: prefill has XA and SSA heads, decode SSA and dense heads."""
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py
    model, router = tiny["llama"]
    knobs = {
        **ELASTIC,
        "mode": "XA-SSA",
        "decode_mode": "sparse",
        "xattn_block": 16,
        "xattn_stride": 4,
        "xattn_threshold": 0.5,
    }
    prompts = [p + " " + p for p in PROMPTS[:2]]  # ~30-35 tokens: 2-3 XA blocks, past the SSA window
    results = {}
    fused = {}
    for ops in ("torch", "triton"):
        cfg = {"elastic": {**knobs, "router_path": str(router)}, "elastic_ops": ops}
        before = observe.COUNTERS.fused_route_layers
        llm = make_llm(
            model, attention_backend="elastic", additional_config=cfg, **{**ENGINE, "max_num_batched_tokens": 32}
        )
        try:
            outs = llm.generate(prompts, greedy(3, logprobs=1), use_tqdm=False)
        finally:
            close_llm(llm)
        results[ops] = [(o.outputs[0].token_ids, top_logprobs(o), event_of(o.request_id)) for o in outs]
        fused[ops] = observe.COUNTERS.fused_route_layers - before
    assert fused["torch"] == 0 and fused["triton"] > 0  # the kernel wrote the routing tables itself
    modes = set()
    for (t_a, lp_a, e_a), (t_b, lp_b, e_b) in zip(results["torch"], results["triton"]):
        assert t_a == t_b
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) <= LOGPROB_ATOL
        assert torch.equal(e_a.decisions, e_b.decisions) and torch.equal(e_a.head_modes, e_b.head_modes)
        torch.testing.assert_close(e_a.logits, e_b.logits, atol=1e-4, rtol=1e-4)
        modes |= set(e_a.head_modes.flatten().tolist())
    assert modes == {1, 2}  # both SSA and XA heads ran


def test_dense_steps_keep_tokens_and_routing(tiny):
    """Steps whose every head is FA (prompts within sink + window, forced all-FA, dense decode) go to the dense
    kernel; routing still runs (same decisions, same metrics) and tokens are those of the elastic kernels.
    The dense kernel here is the PyTorch reference (there is no FlashAttention on the CPU); the real one is
    checked on the GPU (tests/gpu/test_gpu_vllm.py). Prompts of ~16 tokens are within sink + window (2 + 24);
    doubled (~33) they are not, so their auto prefill keeps the hybrid kernel."""
    from elastic_vllm.reference.attention import dense_paged_attention

    from .conftest import elastic_states

    model, router = tiny["llama"]
    cfg = {"elastic": {"sink": 2, "window": 24, "router_path": str(router)}, "elastic_ops": "triton"}
    short, long = PROMPTS[:2], [p + " " + p for p in PROMPTS[:1]]
    llm = make_llm(model, attention_backend="elastic", additional_config=cfg, **ENGINE)
    calls = []

    def dense(*a):
        calls.append(a[4].numel() - 1)  # rows of the step
        return dense_paged_attention(*a)

    def run(prompts, force=None):
        before = observe.COUNTERS.dense_steps
        outs = llm.generate(prompts, greedy(3, force=force), use_tqdm=False)
        return [(o.outputs[0].token_ids, event_of(o.request_id)) for o in outs], observe.COUNTERS.dense_steps - before

    try:
        (st,) = [s for s in elastic_states() if s.cfg.window == 24]
        assert st.dense_attention is None  # no FlashAttention on the CPU: nothing was admitted
        base = {"short": run(short)[0], "long": run(long)[0], "long_fa": run(long, "all-FA")[0]}
        st.dense_attention = dense
        got = {"short": run(short), "long": run(long), "long_fa": run(long, "all-FA")}
    finally:
        close_llm(llm)
    assert got["short"][1] >= 1 and got["long_fa"][1] >= 1 and got["long"][1] == 0
    assert calls and all(n >= 1 for n in calls)
    for k, (outs, _) in got.items():
        for (t_a, e_a), (t_b, e_b) in zip(base[k], outs):
            assert t_a == t_b, k
            assert torch.equal(e_a.decisions, e_b.decisions) and torch.equal(e_a.head_modes, e_b.head_modes), k
            assert e_a.omega_msr == e_b.omega_msr and e_a.omega_esr == e_b.omega_esr, k


def test_fa_split_steps_keep_tokens_and_routing(tiny, monkeypatch):
    """Hybrid prompt steps with their FA heads on the dense kernel (``ops.fa_heads_attention``, one call per KV
    head) and the other heads on the hybrid prefill: the same tokens, decisions and Omegas as the elastic kernels
    alone, with mixed steps (decodes beside prompts) and chunked prompts. The dense kernel here is the PyTorch
    reference; vLLM's FA3 is checked on the GPU (the warm-up's admission, tests/gpu/test_gpu_kernels.py)."""
    from elastic_vllm.reference.attention import dense_paged_attention
    from elastic_vllm.vllm_plugin import state as state_mod

    from .conftest import elastic_states

    monkeypatch.setattr(state_mod, "FA_SPLIT_MIN_SEQ", 0)
    model, router = tiny["llama"]
    cfg = {"elastic": {"sink": 2, "window": 12, "router_path": str(router)}, "elastic_ops": "triton"}
    prompts = [" ".join([p] * k) for k, p in zip((2, 4, 3), PROMPTS)]  # 30-70 tokens, past sink + window
    llm = make_llm(model, attention_backend="elastic", additional_config=cfg, enable_prefix_caching=False,
                   **{**ENGINE, "max_num_batched_tokens": 64})  # fmt: skip
    calls = []

    def dense(*a):
        calls.append((a[1].shape[2], a[4].numel() - 1, int(a[7])))  # KV heads, rows, max_query_len
        return dense_paged_attention(*a)

    def run():
        before = observe.COUNTERS.fa_split_steps
        outs = llm.generate(prompts, greedy(4), use_tqdm=False)
        got = [(o.outputs[0].token_ids, event_of(o.request_id)) for o in outs]
        return got, observe.COUNTERS.fa_split_steps - before

    try:
        (st,) = [s for s in elastic_states() if s.cfg.window == 12]
        assert st.fa_heads_attention is None  # no FlashAttention on the CPU: nothing was admitted
        base, n0 = run()
        st.fa_heads_attention = dense
        got, n1 = run()
        monkeypatch.setattr(state_mod, "FA_SPLIT_MIN_SEQ", 10**6)  # every prompt shorter: no split step
        n_calls = len(calls)
        below, n2 = run()
    finally:
        close_llm(llm)
    assert n0 == 0 and n1 >= 2 and calls and n2 == 0 and len(calls) == n_calls
    assert [t for t, _ in below] == [t for t, _ in base]
    assert {c[0] for c in calls} == {1}  # one call per KV head
    assert any(c[1] > 1 for c in calls)  # a step with several sequences went through the split
    modes = set()
    for (t_a, e_a), (t_b, e_b) in zip(base, got):
        assert t_a == t_b
        assert torch.equal(e_a.decisions, e_b.decisions) and torch.equal(e_a.head_modes, e_b.head_modes)
        assert e_a.omega_msr == e_b.omega_msr and e_a.omega_esr == e_b.omega_esr
        modes |= set(e_a.head_modes.flatten().tolist())
    assert modes == {0, 1}  # both FA and SSA heads ran


def test_preemption_reroutes_identically(tiny):
    """A KV cache too small for the batch: vLLM preempts and later recomputes requests; their routing is
    recomputed from the same keys, equals the first one, and is recorded once."""
    model, router = tiny["llama"]
    cfg = {"elastic": {**ELASTIC, "router_path": str(router)}}
    # 2 KB per token (2 layers x 2 KV heads x 64 x K,V x fp32): 16 blocks of 32 tokens for 4 x ~190 tokens
    llm = make_llm(
        model,
        attention_backend="elastic",
        additional_config=cfg,
        **{**ENGINE, "kv_cache_memory_bytes": 16 * 32 * 2048, "max_model_len": 256},
    )
    try:
        params = greedy(90, ignore_eos=True)
        prompts = [p + " " + p for p in PROMPTS] + [PROMPTS[0] + " and then"]
        before = observe.COUNTERS.snapshot()
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = observe.COUNTERS.snapshot()
    finally:
        close_llm(llm)
    assert after["rerouted"] > before["rerouted"]
    assert after["reroute_mismatches"] == before["reroute_mismatches"]
    assert after["final_routings"] - before["final_routings"] == len(prompts)  # once per request
    for o in outs:
        event_of(o.request_id)
        assert len(o.outputs[0].token_ids) == 90


def test_missing_or_mismatched_router_fails_at_startup(tiny, monkeypatch):
    model, _ = tiny["llama"]
    monkeypatch.setenv("ELASTIC_VLLM_ROUTER_WEIGHTS", str(model / "no-routers"))
    with pytest.raises(Exception, match=r"no router for .*router_path.*force"):
        make_llm(model, attention_backend="elastic", **ENGINE)
    _, qwen_router = tiny["qwen3"]
    with pytest.raises(Exception, match=r"head_dim: router 128 vs model 64"):
        make_llm(
            model,
            attention_backend="elastic",
            additional_config={"elastic": {"router_path": str(qwen_router)}},
            **ENGINE,
        )


def test_without_plugin_vllm_gives_the_same_outputs(tiny):
    """CPU_ATTN with the plugin installed (this process) == CPU_ATTN with the plugin not loaded at all."""
    model, _ = tiny["llama"]
    ref = _CPU_ATTN.get("llama")
    if ref is None:
        cpu = make_llm(model, attention_backend="CPU_ATTN", **ENGINE)
        try:
            ref = [
                (o.outputs[0].token_ids, top_logprobs(o))
                for o in cpu.generate(PROMPTS, greedy(10, logprobs=1), use_tqdm=False)
            ]
        finally:
            close_llm(cpu)
    engine = {**ENGINE, "kv_cache_memory_bytes": ENGINE.get("kv_cache_memory_bytes", KV_BYTES)}
    script = textwrap.dedent(
        f"""
        import json, sys
        from vllm import LLM, SamplingParams
        llm = LLM({str(model)!r}, enforce_eager=True, dtype="float32", seed=0, attention_backend="CPU_ATTN", **{engine!r})
        outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1), use_tqdm=False)
        assert not any(m.startswith("elastic_vllm") for m in sys.modules), "the plugin was imported"
        print("RESULT " + json.dumps([[o.outputs[0].token_ids,
              [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]] for o in outs]))
        """
    )
    env = dict(
        os.environ, VLLM_PLUGINS="lora_filesystem_resolver,lora_hf_hub_resolver", VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for (t_ref, lp_ref), (t, lp) in zip(ref, got):
        assert t == t_ref
        assert max(abs(x - y) for x, y in zip(lp, lp_ref)) <= 1e-6


def _rank_metrics(_worker=None) -> dict[str, float]:
    """This worker's elastic:* Prometheus samples, summed over labels (by value through collective_rpc)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for fam in REGISTRY.collect():
        for smp in fam.samples:
            if smp.name.startswith("elastic:") and not smp.name.endswith("_created"):
                out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


def test_tensor_parallel_ranks_route_their_own_heads(tiny, monkeypatch, tmp_path):
    """TP=2 on the CPU (one KV head per rank): each rank routes its own head, the two ranks together
    decide what one rank decides at TP=1, and the Omega_MSR recorded per request covers both heads (the
    TP=1 value), recorded once (rank 0), with every (layer, head) decision counted once. The router
    sends layer 0's head 0 to FA, every other head to SA: the ranks' own shares (1/2, 1) differ from
    the request's (3/4)."""
    import cloudpickle

    from elastic_vllm.vllm_plugin.observe import rpc_events

    from .hf_ref import HFReference
    from .routers import head_selecting_rules, linear_router

    model, _ = tiny["llama"]
    prompt = PROMPTS[0]
    hf = HFReference(model)
    pooled = hf.pooled(hf.tok(prompt).input_ids)[None]  # [1, L, H, D]; layer 0: the keys vLLM pools too
    rules = {0: head_selecting_rules(pooled, [(0, 0)])[0]}  # layer 1: no rule, every head SA
    router = save_test_router(linear_router(2, TINY["llama"]["head_dim"], rules), tmp_path / "r", 2)
    cfg = {"elastic": {**ELASTIC, "router_path": str(router)}}
    single = make_llm(model, attention_backend="elastic", additional_config=cfg, **ENGINE)
    try:
        one = single.generate([prompt], greedy(3), use_tqdm=False)[0]
    finally:
        close_llm(single)
    want = event_of(one.request_id)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (auto binding needs 2 NUMA nodes)
    tp = make_llm(model, attention_backend="elastic", additional_config=cfg, tensor_parallel_size=2, **ENGINE)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import the tests
    try:
        m0 = tp.collective_rpc(_rank_metrics)  # workers may be forks of this process: deltas
        two = tp.generate([prompt], greedy(3), use_tqdm=False)[0]
        per_rank = tp.collective_rpc(rpc_events)
        m1 = tp.collective_rpc(_rank_metrics)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        close_llm(tp)
    assert [ev[-1]["tp_rank"] for ev in per_rank] == [0, 1]
    assert [ev[-1]["kv_heads"] for ev in per_rank] == [[0], [1]]
    merged = torch.cat([torch.tensor(ev[-1]["decisions"]) for ev in per_rank], dim=1)  # [L, 2] in global order
    logits = torch.cat([torch.tensor(ev[-1]["logits"]) for ev in per_rank], dim=1)
    torch.testing.assert_close(logits, want.logits, atol=1e-4, rtol=1e-4)
    margin = (want.logits[..., 1] - want.logits[..., 0]).abs()
    assert torch.equal(merged[margin > 1e-3], want.decisions[margin > 1e-3])
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    # every rank knows the request's Omegas over both heads; rank 0's own share alone would differ
    assert want.decisions.tolist() == [[True, False], [False, False]]
    assert [ev[-1]["omega_msr"] for ev in per_rank] == [0.5, 1.0] and want.omega_msr == 0.75
    assert [ev[-1]["omega_msr_all"] for ev in per_rank] == pytest.approx([want.omega_msr] * 2, abs=1e-12)
    assert [ev[-1]["omega_esr_all"] for ev in per_rank] == pytest.approx([want.omega_esr] * 2, abs=1e-12)

    def delta(rank, name):
        return m1[rank].get(name, 0.0) - m0[rank].get(name, 0.0)

    assert [delta(r, "elastic:request_omega_msr_count") for r in (0, 1)] == [1, 0]
    assert delta(0, "elastic:request_omega_msr_sum") == pytest.approx(want.omega_msr, abs=1e-6)
    assert delta(0, "elastic:request_omega_esr_sum") == pytest.approx(want.omega_esr, abs=1e-6)
    L, H = want.decisions.shape
    assert [delta(r, "elastic:head_decisions_total") for r in (0, 1)] == [L * H // 2] * 2
