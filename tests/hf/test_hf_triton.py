"""The transformers engine's Triton path (elastic_vllm.ops kernels; TRITON_INTERPRET=1 on the CPU)
equals its torch path: padded batch, FA / SSA / XA heads, prefill and decode."""

import pytest
import torch

from elastic_vllm.hf import enable_elastic, triton_backend
from elastic_vllm.hf.testing import sharp_router, tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not triton_backend.available(), reason="triton not installed"),
]


def test_auto_picks_torch_on_cpu():
    assert enable_elastic(tiny_model("llama"), {"force": "all-FA"}, impl="auto").impl == "torch"


def test_triton_path_matches_torch_path_padded_fa_xa_with_decode():
    router = sharp_router(seed=1)
    model = tiny_model("llama")
    state = enable_elastic(
        model, {"mode": "FA-XA", "sink": 4, "window": 12, "xattn_block": 16, "xattn_stride": 4}, router
    )
    ids = torch.randint(0, 256, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :13] = 0  # left padding: per-row launches over views of the real tokens
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    kw.update(output_scores=True, return_dict_in_generate=True)
    ref = model.generate(**kw)
    routing = state.last_routing.clone()
    assert 0 < routing.sum() < routing.numel()
    state.impl = "triton"
    got = model.generate(**kw)
    assert torch.equal(state.last_routing, routing)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


# --- hybrid_attention against the torch path, one launch per layer --------------------------------------------
from elastic_vllm.config import ElasticConfig, HeadMode  # noqa: E402
from elastic_vllm.hf import ops  # noqa: E402
from elastic_vllm.hf.attention import _compute  # noqa: E402

CFG = {"sink": 2, "window": 6, "xattn_block": 16, "xattn_stride": 4}


def _case(B, Hkv, G, K, Q, D, pad, layout, seed, mode="FA-SSA"):
    """Random q/k/v, a padding mask (None, 'left' or 'right' over the K keys) and mixed head modes."""
    g = torch.Generator().manual_seed(seed)
    cfg = ElasticConfig.parse({**CFG, "mode": mode})
    q = torch.randn(B, Hkv * G, Q, D, generator=g)
    if layout == "projection":  # transformers' k_proj(...).view(B, K, H, D).transpose(1, 2): token stride H*D
        k = torch.randn(B, K, Hkv, D, generator=g).transpose(1, 2)
        v = torch.randn(B, K, Hkv, D, generator=g).transpose(1, 2)
    else:
        k, v = torch.randn(B, Hkv, K, D, generator=g), torch.randn(B, Hkv, K, D, generator=g)
    mask = None
    if pad:
        mask = torch.ones(B, K, dtype=torch.long)
        for b in range(1, B):
            cut = 3 + 4 * b
            if pad == "left":
                mask[b, :cut] = 0
            else:
                mask[b, K - cut :] = 0
    modes = torch.randint(0, 2, (B, Hkv), generator=g)
    if mode != "FA-SSA":
        modes = torch.where(modes == 1, int(cfg.fa_mode), int(cfg.sa_mode))
    return cfg, q, k, v, mask, modes.long()


def _ctx(mask, B, K, Q, impl):
    k_pos, k_valid = ops.token_positions(mask, B, K, "cpu")
    return (k_pos, k_valid, k_pos[:, K - Q :], k_valid[:, K - Q :], mask is not None, impl)


@pytest.fixture
def launches(monkeypatch):
    """Records every kernel launch of the backend (the real kernels still run) with its cache block size."""
    from elastic_vllm.ops.decode import kernel as decode
    from elastic_vllm.ops.prefill import kernel as prefill

    seen = []

    def spy(name, fn):
        def wrapped(q, key_cache, *a, **kw):
            seen.append((name, key_cache.shape[1], "xa_block_idx" in kw))
            return fn(q, key_cache, *a, **kw)

        return wrapped

    monkeypatch.setattr(prefill, "prefill_attention", spy("prefill", prefill.prefill_attention))
    monkeypatch.setattr(decode, "decode_attention", spy("decode", decode.decode_attention))
    return seen


@pytest.mark.parametrize(
    "B,K,Q,pad,layout",
    [
        (2, 40, 40, None, "cache"),  # unpadded prompt
        (3, 40, 40, "left", "projection"),  # generate()'s padding, the projection's layout
        (3, 37, 37, "right", "cache"),
        (3, 41, 1, "left", "cache"),  # decode step
        (2, 30, 3, "left", "projection"),  # a continued prompt: 3 new tokens
    ],
)
def test_hybrid_attention_matches_torch_path(launches, B, K, Q, pad, layout):
    cfg, q, k, v, mask, modes = _case(B, 2, 2, K, Q, 16, pad, layout, seed=K + Q)
    ref = _compute(modes, q, k, v, _ctx(mask, B, K, Q, "torch"), cfg, 0.25, {})
    k_valid = _ctx(mask, B, K, Q, "triton")[1]
    # padding keys poisoned: the real rows must never read them
    kp, vp = k.clone(), v.clone()
    kp.masked_fill_(~k_valid[:, None, :, None], float("nan"))
    vp.masked_fill_(~k_valid[:, None, :, None], float("nan"))
    got = _compute(modes, q, kp, vp, _ctx(mask, B, K, Q, "triton"), cfg, 0.25, {})
    q_valid = k_valid[:, K - Q :]
    real = q_valid[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=1e-5)
    assert torch.all(got[~real] == 0)  # padding queries: zeros, never NaN
    # one launch for the whole batch, over 1-token blocks whatever the length
    assert launches == [("decode" if Q == 1 else "prefill", 1, False)]


def test_hybrid_attention_xa_padded_matches_torch_path(launches):
    B, K = 3, 48
    cfg, q, k, v, mask, modes = _case(B, 2, 2, K, K, 16, "left", "cache", seed=7, mode="FA-XA")
    modes[0, 0], modes[1, 1] = int(HeadMode.XA), int(HeadMode.SSA)  # both sides present
    ctx = _ctx(mask, B, K, K, "torch")
    xa = ops.xa_block_masks(q, k, ctx[1], modes == int(HeadMode.XA), cfg, 0.25)
    assert xa
    ref = _compute(modes, q, k, v, ctx, cfg, 0.25, xa)
    got = _compute(modes, q, k, v, _ctx(mask, B, K, K, "triton"), cfg, 0.25, xa)
    real = ctx[3][:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=1e-5)
    assert launches == [("prefill", 1, True)]


def test_hybrid_attention_rejects_holes_in_a_row():
    cfg, q, k, v, _, modes = _case(2, 2, 2, 20, 20, 16, None, "cache", seed=3)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 5:8] = 0  # real tokens on both sides of a gap
    with pytest.raises(ValueError, match=r"be contiguous.*row 1 .* 17 real tokens of 20, at 0-4, 8-19"):
        _compute(modes, q, k, v, _ctx(mask, 2, 20, 20, "triton"), cfg, 0.25, {})
    dmask = torch.ones(2, 20, dtype=torch.long)
    dmask[1, -1] = 0  # a decode step whose new token is padding
    with pytest.raises(ValueError, match=r"end at the last key.*row 1 .* 19 real tokens of 20, at 0-18"):
        _compute(modes, q[:, :, -1:], k, v, _ctx(dmask, 2, 20, 1, "triton"), cfg, 0.25, {})


def test_token_blocks_are_views_of_the_cache():
    k = torch.randn(3, 2, 10, 8)
    v = torch.randn(3, 2, 10, 8)
    kc, vc, rows = triton_backend.token_blocks(k, v)
    assert kc.data_ptr() == k.data_ptr() and vc.data_ptr() == v.data_ptr() and rows == 20
    for b, t, h in [(0, 0, 0), (1, 3, 1), (2, 9, 1)]:
        assert torch.equal(kc[b * rows + t, 0, h], k[b, h, t]) and torch.equal(vc[b * rows + t, 0, h], v[b, h, t])
    # different layouts for k and v: contiguous copies, same block numbering
    _, vc2, rows2 = triton_backend.token_blocks(k, v.transpose(1, 2).contiguous().transpose(1, 2))
    assert rows2 == 20 and torch.equal(vc2[rows2 + 3, 0, 1], v[1, 1, 3])
