import pytest
import torch

from elastic_vllm.ops.xattn_select.naive import antidiagonal_scores, xattn_block_mask_ref


def test_antidiagonal_scores_brute_force():
    Q, G, D, S, stride = 40, 2, 4, 40, 4
    q, k = torch.randn(Q, G, D), torch.randn(S, D)
    est = antidiagonal_scores(q, k, 0, stride, scale=1.0)
    n = S // stride
    for g in range(G):
        for a in range(n):
            for c in range(n):
                want = sum(float(q[a * stride + stride - 1 - s, g] @ k[c * stride + s]) for s in range(stride)) / stride
                assert est[g, a, c].item() == pytest.approx(want, abs=1e-5)


def test_threshold_one_selects_every_causal_block():
    q, k = torch.randn(256, 2, 16), torch.randn(256, 16)
    m = xattn_block_mask_ref(q, k, 0, stride=8, block=32, threshold=1.0)
    assert torch.equal(m, torch.tril(torch.ones(8, 8, dtype=torch.bool)))


def test_dominant_block_is_selected_and_sink_diag_always_kept():
    S, D, blk = 512, 16, 64
    k = torch.randn(S, D) * 0.01
    q = torch.randn(S, 1, D) * 0.01
    hot = torch.randn(D)
    k[3 * blk : 4 * blk] += 4 * hot  # block 3 holds keys aligned with every query
    q[:, 0] += 4 * hot
    m = xattn_block_mask_ref(q, k, 0, stride=16, block=blk, threshold=0.5)
    nb = S // blk
    for a in range(nb):
        assert m[a, 0] and m[a, a]
        if a >= 3:
            assert m[a, 3]
    assert not torch.triu(m, 1).any()  # never a future block
    # a low threshold keeps few blocks for the last row
    assert m[nb - 1].sum() <= 3


def test_chunked_rows_only():
    q, k = torch.randn(64, 1, 8), torch.randn(192, 8)
    m = xattn_block_mask_ref(q, k, q_start=128, stride=8, block=64, threshold=0.9)
    assert not m[:2].any() and m[2, 0] and m[2, 2]
