"""Routers with known decisions, built for tests (the trained router comes later in router_weights/).

The router MLPs can be set to compute an exact linear rule per layer: the Task MLP and the first two
layers of the Router MLP become the identity (SiLU(x) - SiLU(-x) = x), and the last two layers turn
one coordinate z = w.x + c into logits whose FA-minus-SA difference has the sign of z::

    FA?  <=>  w_l . pooled_pre_rope_keys(head) + c_l > 0

Heads of one layer share the router, so a rule singles out heads by their pooled keys, which differ
far more between heads than between prompts on SmolLM2 (measured: centroid distance >= 7, spread <= 9
over prompts at layer 18, ~4x elsewhere), or splits two prompts at one head.
"""

from __future__ import annotations

from pathlib import Path

import torch

from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, save_router
from elastic_vllm.router.model import ElasticRouter

OFFSET = 100.0  # keeps the rule's coordinate in SiLU's linear range; the sign is exact regardless

# (layer, KV head) of SmolLM2-135M-Instruct ranked by needle retrieval score (attention mass on the needle digits under
# dense attention, 20 prompts of ~4K tokens; the top 9 hold 82% of it)
SMOLLM2_RETRIEVAL_HEADS = [(18, 2), (17, 1), (21, 2), (7, 2), (23, 0), (14, 1), (20, 1), (21, 0), (22, 2), (15, 2)]


def linear_router(num_layers: int, head_dim: int, rules: dict[int, tuple[torch.Tensor, float]]) -> ElasticRouter:
    """rules[layer] = (w [head_dim], c): FA iff w.x + c > 0; layers without a rule route every head SA."""
    d = head_dim
    r = ElasticRouter(num_layers, d)
    eye = torch.eye(d)
    up = torch.zeros(4 * d, d)
    up[:d], up[d : 2 * d] = eye, -eye
    down = torch.zeros(d, 4 * d)
    down[:, :d], down[:, d : 2 * d] = eye, -eye
    with torch.no_grad():
        for i, layer in enumerate(r.layers):
            w, c = rules.get(i, (torch.zeros(d), -10.0))
            fe, rh = layer.cls_feat_extractor, layer.cls_router_head_agnostic
            fe[0].weight.copy_(up), fe[0].bias.zero_(), fe[2].weight.copy_(down), fe[2].bias.zero_()
            rh[0].weight.copy_(up), rh[0].bias.zero_()
            rh[2].weight.zero_(), rh[2].bias.zero_()
            rh[2].weight[0] = torch.cat([w, -w, torch.zeros(2 * d)])
            rh[2].bias[0] = c + OFFSET
            rh[4].weight.zero_()
            rh[4].weight[0, 0], rh[4].weight[1, 0] = -0.5, 0.5
            rh[4].bias.copy_(torch.tensor([0.5 * OFFSET, -0.5 * OFFSET]))
    return r


def head_selecting_rules(pooled: torch.Tensor, fa_heads: list[tuple[int, int]], margin: float = 10.0) -> dict:
    """Rules making exactly ``fa_heads`` FA, from pooled keys [N prompts, L, H, D] (centroids per head)."""
    _N, L, H, _D = pooled.shape
    mu = pooled.mean(0)  # [L, H, D]
    rules = {}
    for layer in range(L):
        targets = {h for (l_, h) in fa_heads if l_ == layer}
        if not targets:
            continue
        if len(targets) == H:
            rules[layer] = (torch.zeros(pooled.shape[-1]), margin)
            continue
        a = torch.cat([mu[layer], torch.ones(H, 1)], dim=1).double()  # [H, D+1]
        y = torch.tensor([margin if h in targets else -margin for h in range(H)], dtype=torch.float64)
        sol = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)  # min-norm exact fit
        rules[layer] = (sol[:-1].float(), float(sol[-1]))
    return rules


def prompt_splitting_rule(pa: torch.Tensor, pb: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Rule of one (layer, head): FA for pooled keys pa, SA for pb (their perpendicular bisector)."""
    w = (pa - pb).float()
    c = -float(w @ (pa + pb).float()) / 2
    return w, c


def save_test_router(router: ElasticRouter, path: Path, num_kv_heads: int, backbone_id: str = "test") -> Path:
    meta = RouterMeta(
        backbone=BackboneMeta(
            num_layers=router.num_layers, num_kv_heads=num_kv_heads, head_dim=router.head_dim, id=backbone_id
        ),
        training={"note": "constructed for tests (tests/vllm_cpu/routers.py), not trained"},
    )
    return save_router(router, path, meta)
