"""transformers integration: attn_implementation="elastic" + routers on Llama, Qwen2 and Qwen3 (tiny, random)."""

import contextlib

import pytest
import torch
from transformers import AttentionInterface

from elastic_vllm.config import ElasticConfig
from elastic_vllm.hf import ATTN_IMPLEMENTATION, attention_modules, disable_elastic, enable_elastic, testing
from elastic_vllm.hf.attention import elastic_attention_forward
from elastic_vllm.hf.testing import tiny_model
from elastic_vllm.reference.attention import hybrid_attention_ref, write_paged
from elastic_vllm.reference.rope import RopeSpec, invert_rope
from elastic_vllm.router.checkpoint import BackboneMeta, RouterCheckpointError, RouterMeta, save_router
from elastic_vllm.router.model import ElasticRouter

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "qwen2", "qwen3"]
L, HKV, D = 3, 2, 16
CFG = dict(sink=4, window=12, xattn_block=16, xattn_stride=4)


def sharp_router(seed=0, gain=30.0):
    return testing.sharp_router(L, D, seed, gain)


def batch(lengths, seed=0, vocab=256):
    """Left-padded random prompts."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), 258, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n :] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, T - n :] = 1
    return ids, mask


def real(mask):
    return mask.bool()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stock", ["sdpa", "eager"])
def test_all_fa_equals_stock_model(family, stock):
    model = tiny_model(family, attn_implementation=stock)
    ids, mask = batch([37, 50])
    ref = model(input_ids=ids, attention_mask=mask).logits
    enable_elastic(model, {**CFG, "force": "all-FA"}, sharp_router())
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[real(mask)], ref[real(mask)], atol=2e-5, rtol=1e-5)
    assert model.elastic_state.last_routing.all()
    # and back to stock
    disable_elastic(model, stock)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_sees_pre_rope_post_k_norm_keys(family):
    model = tiny_model(family)
    enable_elastic(model, {**CFG, "force": "all-FA"})
    ids = torch.randint(0, 256, (2, 23))
    out = model(input_ids=ids, use_cache=True, output_hidden_states=True)
    spec = RopeSpec.from_hf_config(model.config)
    for layer, attn in enumerate(attention_modules(model)):
        captured = attn._elastic_keys  # [B, T, Hkv, D]
        # 1. the cache holds RoPE(keys): rotating back gives the captured keys
        post = out.past_key_values.layers[layer].keys.transpose(1, 2)
        for b in range(2):
            torch.testing.assert_close(invert_rope(post[b], torch.arange(23), spec), captured[b], atol=2e-5, rtol=1e-5)
        # 2. recomputed by hand from the layer input: k_proj (+ k_norm for Qwen3), no RoPE
        h = model.model.layers[layer].input_layernorm(out.hidden_states[layer])
        k = attn.k_proj(h).view(2, 23, HKV, D)
        if family == "qwen3":
            k = attn.k_norm(k)
        torch.testing.assert_close(captured, k)


def test_decisions_are_per_request():
    model = tiny_model("qwen3")
    state = enable_elastic(model, CFG, sharp_router(seed=0))
    ids, mask = batch([30, 45], seed=1)
    ids[0, -30:] = 65  # a prompt unlike the random one, so the router tells them apart
    model(input_ids=ids, attention_mask=mask)
    both, both_logits = state.last_routing.clone(), state.last_logits.clone()
    assert both.shape == (2, L, HKV) and both_logits.shape == (2, L, HKV, 2)
    assert not torch.equal(both[0], both[1]), "pick prompts the router tells apart"
    for b in range(2):
        alone = ids[b : b + 1, mask[b].bool()]
        model(input_ids=alone)
        assert torch.equal(state.last_routing[0], both[b])
        torch.testing.assert_close(state.last_logits[0], both_logits[b], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["FA-SSA", "FA-XA", "XA-SSA"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_path_matches_reference_oracle(mode, family):
    model = tiny_model(family)
    state = enable_elastic(model, {**CFG, "mode": mode}, sharp_router(seed=1))
    ids, mask = batch([70, 41], seed=2)
    fast = model(input_ids=ids, attention_mask=mask).logits
    routing = state.last_routing.clone()
    assert 0 < routing.sum() < routing.numel(), "want a mix of FA and SA heads"
    state.impl = "reference"
    ref = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(state.last_routing, routing)
    torch.testing.assert_close(fast[real(mask)], ref[real(mask)], atol=5e-5, rtol=1e-5)
    # the same through generate (prefill + decode steps)
    state.impl = "torch"
    g1 = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    state.impl = "reference"
    g2 = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(g1, g2)


@contextlib.contextmanager
def recording_attention():
    """Wrap the registered elastic attention function to record its inputs and output."""
    calls = []

    def wrapper(module, q, k, v, mask, **kw):
        out = elastic_attention_forward(module, q, k, v, mask, **kw)
        calls.append((int(module.layer_idx), q.detach(), k.detach(), v.detach(), out[0].detach()))
        return out

    AttentionInterface.register(ATTN_IMPLEMENTATION, wrapper)
    try:
        yield calls
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, elastic_attention_forward)


@pytest.mark.parametrize("mode", ["FA-SSA", "FA-XA"])
def test_layer_outputs_equal_reference_hybrid_attention_over_paged_cache(mode):
    """Each layer's output equals hybrid_attention_ref run on the same q/k/v written into a paged
    cache with permuted blocks, head modes from the recorded routing and XA blocks from the state."""
    cfg = ElasticConfig(**{**CFG, "mode": mode, "xattn_threshold": 0.3})
    model = tiny_model("llama")
    state = enable_elastic(model, cfg, sharp_router(seed=1))
    ids = torch.randint(0, 256, (2, 53))
    with recording_attention() as calls:
        model(input_ids=ids)
    assert len(calls) == L
    bs, T = 8, 53
    nblk = -(-T // bs)
    seen = set()
    for layer, q, k, v, out in calls:
        B = q.shape[0]
        perm = torch.randperm(B * nblk) + 1  # block 0 reserved
        kc = torch.zeros(B * nblk + 1, bs, HKV, D)
        vc = torch.zeros_like(kc)
        bt = perm.view(B, nblk)
        for b in range(B):
            slots = bt[b].repeat_interleave(bs)[:T] * bs + torch.arange(T) % bs
            write_paged(kc, vc, k[b].transpose(0, 1), v[b].transpose(0, 1), slots)
        is_fa = state.last_routing[:, layer]
        modes = torch.where(is_fa, int(cfg.fa_mode), int(cfg.sa_mode))
        seen |= set(modes.flatten().tolist())
        nb = -(-T // cfg.xattn_block)
        xa = [
            torch.stack([state.xa_masks.get((b, layer, h), torch.zeros(nb, nb, dtype=torch.bool)) for h in range(HKV)])
            for b in range(B)
        ]
        ref = hybrid_attention_ref(
            q.transpose(1, 2).reshape(B * T, -1, D),
            kc,
            vc,
            bt,
            torch.arange(B + 1) * T,
            torch.full((B,), T),
            modes,
            cfg.sink,
            cfg.window,
            xa_block_masks=xa,
            xa_block=cfg.xattn_block,
        )
        torch.testing.assert_close(out.reshape(B * T, -1, D), ref, atol=2e-6, rtol=1e-5)
    assert seen == {int(cfg.fa_mode), int(cfg.sa_mode)}
    if mode == "FA-XA":  # XA really pruned some causal blocks
        assert any(int(m.sum()) < nb * (nb + 1) // 2 for m in state.xa_masks.values())


def test_generate_routes_once_and_reuses_the_decision():
    model = tiny_model("llama")
    state = enable_elastic(model, CFG, sharp_router(seed=3))
    ids, mask = batch([30, 45], seed=1)
    model(input_ids=ids, attention_mask=mask)
    prefill_routing = state.last_routing.clone()
    state.num_prefills = state.num_router_calls = 0
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert state.num_prefills == 1
    assert state.num_router_calls == L  # once per layer, at prefill only
    assert torch.equal(state.last_routing, prefill_routing)


def test_decode_without_prefill_is_refused():
    model = tiny_model("llama")
    state = enable_elastic(model, CFG, sharp_router())
    out = model(input_ids=torch.randint(0, 256, (2, 10)), use_cache=True)
    state.routing = None
    with pytest.raises(RuntimeError, match="prefill the prompts"):
        model(input_ids=torch.randint(0, 256, (2, 1)), past_key_values=out.past_key_values)


def _oracle_attention(fixed, prompt_len, cfg, decode_mode):
    """Independent oracle for one forward over prompt + generated tokens: query i < prompt_len uses the
    head's prefill mode; a query i >= prompt_len (a decode step) uses what decode_mode specifies."""

    def fn(module, q, k, v, mask, scaling=None, **kw):
        _, Hq, T, _ = q.shape
        G = Hq // k.shape[1]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None]
        causal = j <= i
        ssa = causal & ((j < cfg.sink) | (i - j < cfg.window))
        decode_ssa = ssa if decode_mode == "sparse" else causal
        sa_mask = torch.where(i < prompt_len, ssa, decode_ssa)
        out = torch.empty_like(q)
        for h in range(Hq):
            m = causal if fixed[int(module.layer_idx), h // G] else sa_mask
            s = (q[:, h] @ k[:, h // G].transpose(-1, -2)) * scaling
            out[:, h] = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ v[:, h // G]
        return out.transpose(1, 2), None

    return fn


@pytest.mark.parametrize("decode_mode", ["dense", "sparse"])
def test_decode_mode_semantics(decode_mode):
    cfg = ElasticConfig(sink=3, window=6, decode_mode=decode_mode)
    fixed = torch.tensor([[True, False], [False, False], [False, True]])
    model = tiny_model("llama")
    state = enable_elastic(model, cfg)
    state.fixed_routing = fixed
    prompt = torch.randint(0, 256, (1, 20))
    steps = torch.randint(0, 256, (1, 4))
    out = model(input_ids=prompt, use_cache=True)
    pkv, got = out.past_key_values, []
    for t in range(steps.shape[1]):
        o = model(input_ids=steps[:, t : t + 1], past_key_values=pkv, use_cache=True)
        pkv = o.past_key_values
        got.append(o.logits[0, -1])
    got = torch.stack(got)
    assert torch.equal(state.last_routing[0], fixed)
    # oracle: one plain forward over prompt + steps with the specified per-query masks
    AttentionInterface.register("elastic_test_oracle", _oracle_attention(fixed, 20, cfg, decode_mode))
    disable_elastic(model, "elastic_test_oracle")
    full = torch.cat([prompt, steps], 1)
    want = model(input_ids=full).logits[0, 20:24]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # dense and sparse decode really differ here (the window is shorter than the context)
    other = "sparse" if decode_mode == "dense" else "dense"
    AttentionInterface.register("elastic_test_oracle", _oracle_attention(fixed, 20, cfg, other))
    assert (model(input_ids=full).logits[0, 20:24] - got).abs().max() > 1e-3


def test_xa_heads_are_dense_at_decode():
    model = tiny_model("llama")
    state = enable_elastic(model, {**CFG, "mode": "FA-XA", "decode_mode": "sparse"}, sharp_router(seed=1))
    ids, mask = batch([40, 33], seed=4)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
               return_dict_in_generate=True)  # fmt: skip
    sparse = model.generate(**gen)
    state.set_config(decode_mode="dense")
    dense = model.generate(**gen)
    for a, b in zip(sparse.scores, dense.scores):
        torch.testing.assert_close(a, b)


def test_router_checkpoint_for_another_model_is_refused(tmp_path):
    model = tiny_model("llama")
    meta = RouterMeta(backbone=BackboneMeta(num_layers=4, num_kv_heads=HKV, head_dim=D, id="other"))
    save_router(ElasticRouter(4, D), tmp_path / "r", meta)
    with pytest.raises(RouterCheckpointError, match="num_layers: router 4 vs model 3"):
        enable_elastic(model, CFG, tmp_path / "r")
    trained_with = ElasticConfig(sink=3, window=24).model_dump(mode="json")
    meta = RouterMeta(
        backbone=BackboneMeta(num_layers=L, num_kv_heads=HKV, head_dim=D, id="tiny"), attention=trained_with
    )
    save_router(sharp_router(), tmp_path / "ok", meta)
    state = enable_elastic(model, CFG, tmp_path / "ok")
    model(input_ids=torch.randint(0, 256, (1, 9)))
    assert state.last_logits.shape == (1, L, HKV, 2) and state.cfg.window == CFG["window"]
    # no config given: the one the router was trained with
    assert enable_elastic(model, None, tmp_path / "ok").cfg.window == 24
