"""Routers with a fixed Omega_MSR for the benchmarks: every request gets the same (layer, KV head) routing
through the normal routing path (the fused router kernel reads the request's keys, runs both MLPs and
thresholds the logits), so the router's cost is paid as in serving and only the decisions are fixed.

Two layouts of the SA heads:

- ``within="layers"``: whole layers, the first round((1 - share) x L) layers FA and the rest SA (each layer is
  all-FA or all-SA);
- ``within="heads"``: round(share x H) SA heads in every layer (2 FA + 6 SA of the 8 KV heads at 0.75), the FA
  heads rotating with the layer, as a trained router mixes FA and SA heads inside a layer.

How the decisions are fixed: the router's per-(layer, KV head) input standardization (``input_shift`` /
``input_scale``, ``ElasticRouter.set_input_norm``). The scale 2^-20 shrinks the pooled keys to nothing (keys of
norm ~1e2 move a coordinate by ~1e-4) and the shift puts coordinate 0 at +8 for an FA head and -8 for an SA head;
the MLPs, shared by every head as in a trained router, pass that coordinate through (SiLU(u) - SiLU(-u) = u) and
turn it into the FA-minus-SA logit 2 SiLU(u) - 8: +7.99 or -8.01. A margin of 8 either way: no bias the servers
apply here moves a decision.
"""

from __future__ import annotations

import json
from pathlib import Path

WITHIN = ("layers", "heads")
SCALE = 2.0**-20  # power of two: (x - shift) * scale rounds only in the subtraction
U = 8.0  # |coordinate 0| after the standardization; the FA-minus-SA logit is +-U


def fa_layout(num_layers: int, num_kv_heads: int, share: float, within: str) -> list[list[bool]]:
    """[layer][KV head] True = FA, for an SA share ``share`` laid out ``within`` layers or heads."""
    if within not in WITHIN:
        raise ValueError(f"within: one of {', '.join(WITHIN)}, got {within!r}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share: an SA share in [0, 1], got {share}")
    L, H = num_layers, num_kv_heads
    if within == "layers":
        n_fa = L - round(share * L)
        return [[layer < n_fa] * H for layer in range(L)]
    n_fa = H - round(share * H)
    return [[(h - layer * n_fa) % H < n_fa for h in range(H)] for layer in range(L)]


def build_router(fa: list[list[bool]], head_dim: int):
    """An ``ElasticRouter`` whose decision at (layer, KV head) is ``fa[layer][head]`` whatever the keys."""
    import torch

    from elastic_vllm.router.model import ElasticRouter

    L, H, d = len(fa), len(fa[0]), head_dim
    r = ElasticRouter(L, d)
    with torch.no_grad():
        for layer in r.layers:
            fe, rh = layer.cls_feat_extractor, layer.cls_router_head_agnostic
            for lin in (*fe[::2], *rh[::2]):
                lin.weight.zero_()
                lin.bias.zero_()
            for up, down in ((fe[0], fe[2]), (rh[0], rh[2])):  # coordinate 0 through: SiLU(u) - SiLU(-u) = u
                up.weight[0, 0], up.weight[1, 0] = 1.0, -1.0
                down.weight[0, 0], down.weight[0, 1] = 1.0, -1.0
            out = rh[4]  # after the last SiLU: logits (-s, s) + (U/2, -U/2), s = SiLU(u); index 1 = FA
            out.weight[0, 0], out.weight[1, 0] = -1.0, 1.0
            out.bias.copy_(torch.tensor([U / 2, -U / 2]))
    shift = torch.zeros(L, H, d)
    shift[..., 0] = torch.tensor([[-U / SCALE if f else U / SCALE for f in row] for row in fa])
    r.set_input_norm(shift, torch.full((L, H, d), SCALE))
    return r


def fixed_share_router(model_dir: Path, work: Path, share: float, within: str = "layers") -> Path:
    """Save the router of Omega_MSR ``share`` (``within`` layers or heads, see the module docstring) for the model
    in ``model_dir`` under ``work``; returns its folder. The realized Omega_MSR is round(share x L) / L (layers) or
    round(share x H) / H (heads), exactly ``share`` where that is whole."""
    from elastic_vllm.router.checkpoint import BackboneMeta, BackboneShape, RouterMeta, save_router

    cfg = json.loads((model_dir / "config.json").read_text())
    shape = BackboneShape.from_hf_config(type("C", (), cfg))
    fa = fa_layout(shape.num_layers, shape.num_kv_heads, share, within)
    n_fa = sum(map(sum, fa))
    omega = 1 - n_fa / (shape.num_layers * shape.num_kv_heads)
    meta = RouterMeta(
        backbone=BackboneMeta(**shape.model_dump(), id=model_dir.name, model_type=cfg.get("model_type", "unknown")),
        training={
            "note": f"fixed-share router (benchmarks/_routers.py): SA share {share} within {within}, "
            f"Omega_MSR {omega:.4f}, decided by the input standardization whatever the input",
        },
    )
    return save_router(build_router(fa, shape.head_dim), work / f"router-{within}-{share}", meta)
