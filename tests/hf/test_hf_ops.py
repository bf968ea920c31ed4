"""The torch attention paths of the transformers integration against independently built masks."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.hf import ops
from elastic_vllm.hf.attention import gumbel_straight_through, pool_prompt_keys
from elastic_vllm.router.model import pool_keys

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)


def loop_mask(mode, q_pos, k_pos, sink, window, bm=None, blk=4):
    m = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
    for a, i in enumerate(q_pos):
        for c, j in enumerate(k_pos):
            if j > i:
                continue
            m[a, c] = (
                True if mode == FA else (j < sink or i - j < window) if mode == SSA else bool(bm[i // blk, j // blk])
            )
    return m


def oracle(q, k, v, masks, scale):
    """float64 SDPA per (row, query head) under masks[b][h] [Q, K]."""
    B, Hq, Q, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, Q, D, dtype=torch.float64)
    for b, hq in itertools.product(range(B), range(Hq)):
        m = masks[b][hq // G]
        m = m | ~m.any(-1, keepdim=True)
        out[b, hq] = F.scaled_dot_product_attention(
            q[b, hq].double(), k[b, hq // G].double(), v[b, hq // G].double(), attn_mask=m, scale=scale
        )
    return out


# (T, sink, window): ragged lengths, window 1, window >= T, sink >= T, sink overlapping the first window
GRID = [(1, 2, 4), (63, 4, 16), (113, 16, 16), (113, 0, 1), (40, 64, 8), (100, 3, 200), (129, 7, 31)]


@pytest.mark.parametrize("T,sink,window", GRID)
@pytest.mark.parametrize("gqa", [(4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_ssa_banded_matches_mask(T, sink, window, gqa, dtype, atol):
    Hq, Hkv = gqa
    q, k, v = (torch.randn(2, h, T, 8, dtype=dtype) for h in (Hq, Hkv, Hkv))
    out = ops.ssa_attention_banded(q, k, v, sink, window, 0.35)
    pos = list(range(T))
    m = loop_mask(SSA, pos, pos, sink, window)
    ref = oracle(q, k, v, [[m] * Hkv] * 2, 0.35)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def test_ssa_banded_gradients_match_dense_mask():
    T, sink, window = 70, 5, 16
    q, k, v = (torch.randn(1, h, T, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    m = (j <= i) & ((j < sink) | (i - j < window))
    g = torch.randn(1, 4, T, 8, dtype=torch.float64)
    (ops.ssa_attention_banded(q, k, v, sink, window, 0.3) * g).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q, ops.repeat_kv(k, 2), ops.repeat_kv(v, 2), attn_mask=m, scale=0.3)
    (ref * g).sum().backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)


@pytest.mark.parametrize("q_len", [40, 1])
def test_masked_attention_with_padding_and_modes(q_len):
    """Left-padded rows, mixed FA/SSA/XA heads, prefill and single-token decode."""
    cfg = ElasticConfig(sink=2, window=5, xattn_block=16, xattn_stride=4)
    B, Hq, Hkv, K, D = 2, 6, 3, 40, 8
    pad = torch.ones(B, K, dtype=torch.bool)
    pad[1, :9] = False
    k_pos, k_valid = ops.token_positions(pad, B, K, "cpu")
    q_pos = k_pos[:, K - q_len :]
    modes = torch.tensor([[FA, SSA, XA], [XA, FA, SSA]])
    xa = {}
    for b, h in (modes == XA).nonzero().tolist():
        bm = torch.rand(3, 3) < 0.5
        bm[torch.arange(3), torch.arange(3)] = True
        xa[(b, h)] = bm
    q, k, v = torch.randn(B, Hq, q_len, D), torch.randn(B, Hkv, K, D), torch.randn(B, Hkv, K, D)
    out = ops.masked_attention(q, k, v, ops.head_masks(modes, q_pos, k_pos, k_valid, cfg, xa), 0.4)
    masks = []
    for b in range(B):
        row = []
        for h in range(Hkv):
            bm = xa.get((b, h))
            m = loop_mask(int(modes[b, h]), q_pos[b].tolist(), k_pos[b].tolist(), 2, 5, bm, 16)
            row.append(m & k_valid[b][None])
        masks.append(row)
    ref = oracle(q, k, v, masks, 0.4)
    real = torch.ones(B, q_len, dtype=torch.bool)
    if q_len > 1:
        real[1, :9] = False  # padding queries carry garbage nobody reads
    for b in range(B):
        torch.testing.assert_close(out[b][:, real[b]].double(), ref[b][:, real[b]], atol=2e-6, rtol=0)
    assert torch.isfinite(out).all()


def test_masked_attention_accepts_a_permuted_sdpa_output(monkeypatch):
    """CUDA's SDPA (efficient / flash backends) returns [B, H, L, D] with [B, L, H, D] strides; the grouped
    output must still come back as [B, Hq, Q, D] (a `.view` raised on the H200). The layout is forced here; the
    real CUDA call is checked by tests/gpu/test_gpu_kernels.py ("hf triton path")."""
    cfg = ElasticConfig(sink=2, window=5)
    B, Hq, Hkv, K, D = 2, 4, 2, 24, 8
    k_pos, k_valid = ops.token_positions(torch.ones(B, K, dtype=torch.bool), B, K, "cpu")
    modes = torch.tensor([[FA, SSA], [SSA, FA]])
    q, k, v = torch.randn(B, Hq, K, D), torch.randn(B, Hkv, K, D), torch.randn(B, Hkv, K, D)
    mask = ops.head_masks(modes, k_pos, k_pos, k_valid, cfg, {})
    want = ops.masked_attention(q, k, v, mask, 0.3)
    real_sdpa = F.scaled_dot_product_attention

    def permuted(*a, **kw):
        o = real_sdpa(*a, **kw)
        p = o.transpose(1, 2).contiguous().transpose(1, 2)
        assert not p.is_contiguous()
        return p

    monkeypatch.setattr(F, "scaled_dot_product_attention", permuted)
    got = ops.masked_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_pooling_matches_router_pool_keys_per_row():
    keys = torch.randn(3, 30, 2, 4)
    prompt = torch.ones(3, 30, dtype=torch.bool)
    prompt[1, :9] = False  # left padding
    prompt[2, 21:] = False  # answer tokens after the prompt are not pooled
    for pooling in ("boundary", "whole"):
        got = pool_prompt_keys(keys, prompt, pooling, 5)
        for b in range(3):
            want = pool_keys(keys[b][prompt[b]], pooling, 5)
            torch.testing.assert_close(got[b], want)


def test_gumbel_straight_through_is_hard_forward_soft_backward():
    z = torch.randn(4, 3, 2, requires_grad=True)
    r = gumbel_straight_through(z, None, 1.5)
    assert torch.equal(r.detach(), F.one_hot(z.argmax(-1), 2).float())
    (r[..., 1] * torch.arange(12.0).view(4, 3)).sum().backward()
    soft = torch.softmax(z.detach() / 1.5, -1)
    # d r_fa / d z_fa = p_fa (1 - p_fa) / tau
    torch.testing.assert_close(z.grad[..., 1], torch.arange(12.0).view(4, 3) * soft[..., 1] * soft[..., 0] / 1.5)
