import math

import pytest
import torch

from elastic_vllm.router.model import (
    ElasticRouter,
    LayerRouter,
    boundary_positions,
    decide,
    num_parameters_per_layer,
    pool_keys,
    pool_keys_varlen,
)


def test_parameter_count_matches_paper():
    # the paper's router at d = 128: 263,682 parameters per layer (the paper's "0.27M")
    assert num_parameters_per_layer(128) == 263_682


def _silu(x):
    return x / (1 + math.exp(-x))


def test_forward_hand_computed():
    """d=1, hidden 2: every weight set by hand, output computed with plain math."""
    r = LayerRouter(head_dim=1, hidden_mult=2)
    f0, f2 = r.cls_feat_extractor[0], r.cls_feat_extractor[2]
    h0, h2, h4 = r.cls_router_head_agnostic[0], r.cls_router_head_agnostic[2], r.cls_router_head_agnostic[4]
    with torch.no_grad():
        f0.weight.copy_(torch.tensor([[1.0], [-2.0]])), f0.bias.copy_(torch.tensor([0.5, 0.0]))
        f2.weight.copy_(torch.tensor([[1.0, 1.0]])), f2.bias.copy_(torch.tensor([-0.25]))
        h0.weight.copy_(torch.tensor([[2.0], [1.0]])), h0.bias.copy_(torch.tensor([0.0, 1.0]))
        h2.weight.copy_(torch.tensor([[0.5, -1.0]])), h2.bias.copy_(torch.tensor([0.1]))
        h4.weight.copy_(torch.tensor([[1.0], [-1.0]])), h4.bias.copy_(torch.tensor([0.0, 0.2]))
    x = 0.3
    t = f2_out = _silu(1 * x + 0.5) * 1 + _silu(-2 * x) * 1 - 0.25  # Task MLP
    a, b = _silu(2 * t), _silu(1 * t + 1.0)
    u = _silu(0.5 * a - 1.0 * b + 0.1)
    expected = [u, -u + 0.2]
    got = r(torch.tensor([[x]]))[0].tolist()
    assert f2_out == t
    assert got == pytest.approx(expected, abs=1e-6)


def test_decide_index_one_is_fa_and_ties_go_to_sa():
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])
    assert decide(logits).tolist() == [True, False, False]


def test_boundary_positions():
    assert boundary_positions(5, 2).tolist() == [0, 1, 3, 4]
    assert boundary_positions(4, 2).tolist() == [0, 1, 2, 3]
    assert boundary_positions(1, 100).tolist() == [0]
    assert boundary_positions(450, 100).tolist() == list(range(100)) + list(range(350, 450))
    with pytest.raises(ValueError):
        boundary_positions(0, 100)


def test_pool_keys_boundary_and_whole():
    T, H, d = 300, 3, 8
    k = torch.randn(T, H, d)
    want = torch.cat([k[:100], k[200:]]).mean(0)
    torch.testing.assert_close(pool_keys(k, "boundary", 100), want)
    torch.testing.assert_close(pool_keys(k, "whole"), k.mean(0))
    short = k[:150]
    torch.testing.assert_close(pool_keys(short, "boundary", 100), short.mean(0))  # no token twice
    with pytest.raises(ValueError, match="unknown pooling"):
        pool_keys(k, "middle")


def test_varlen_pooling_and_batched_routing_are_per_request():
    H, d = 2, 16
    lens = [7, 250, 1]
    keys = torch.randn(sum(lens), H, d)
    cu = torch.tensor([0, 7, 257, 258])
    pooled = pool_keys_varlen(keys, cu, "boundary", 100)
    assert pooled.shape == (3, H, d)
    router = ElasticRouter(num_layers=2, head_dim=d)
    batched = router(1, pooled)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        torch.testing.assert_close(batched[b], router(1, pool_keys(keys[s:e])))
    assert router.route(1, pooled).dtype == torch.bool


def test_router_rejects_wrong_head_dim():
    with pytest.raises(ValueError, match="head_dim 16"):
        ElasticRouter(1, 16)(0, torch.randn(2, 3, 8))
