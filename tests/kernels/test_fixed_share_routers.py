"""The benchmarks' fixed-share routers (benchmarks/_routers.py) through the fused router kernel (elastic_vllm/ops/route/kernel.py,
under TRITON_INTERPRET=1) with the Llama-3.1-8B shape's 32 layers and 8 KV heads (head_dim 32 here, 128 there: the
interpreter's cost grows with it, the decisions do not depend on it): the head-mixing router
realizes exactly 2 FA + 6 SA KV heads in every layer at 0.75 (4 + 4 at 0.5), the whole-layer router whole layers,
for prompts of any keys, with margins far from the threshold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elastic_vllm.ops.route.kernel import pack_router_norm, pack_router_weights, route
from elastic_vllm.reference.paged import make_paged_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _routers import U, build_router, fa_layout

pytestmark = pytest.mark.slow  # ~20 s of interpreted router kernels

L, HKV, D = 32, 8, 32
LAYERS = (0, 5, 31)  # heads 0-1, 2-3, 6-7 FA at 0.75; whole layers: an FA layer and two SA ones


@pytest.mark.parametrize(
    ("within", "share", "fa_per_layer"), [("heads", 0.75, 2), ("heads", 0.5, 4), ("layers", 0.75, None)]
)
def test_fixed_share_router_realizes_its_layout_in_the_kernel(within, share, fa_per_layer):
    fa = torch.tensor(fa_layout(L, HKV, share, within))
    if fa_per_layer is not None:  # every layer mixes FA and SA heads, each head FA in some layers
        assert fa.sum(1).tolist() == [fa_per_layer] * L and fa.any(0).all()
    else:
        assert fa.all(1)[:8].all() and not fa[8:].any()
    assert 1 - fa.float().mean().item() == share
    router = build_router(fa.tolist(), D)
    lens = [150, 333]  # a prompt pooled whole, one pooled by its boundaries
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch(lens, lens, HKV, HKV, D, block_size=16, generator=gen)
    kc = batch.key_cache * 100 + 15  # keys far larger than a real model's: the decisions do not move
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2).float() / D))
    rows = torch.arange(len(lens), dtype=torch.int32)
    plens = torch.tensor(lens, dtype=torch.int32)
    weights, norm = pack_router_weights(router), pack_router_norm(router)
    table = torch.full((len(lens), L, HKV), 9, dtype=torch.int8)
    for layer in LAYERS:
        logits = torch.full((len(lens), HKV, 2), float("nan"))
        route(kc, batch.block_table, rows, plens, rows, weights, layer, table, inv_freq=inv, norm=norm,
              logits_out=logits)  # fmt: skip
        margin = logits[..., 1] - logits[..., 0]
        assert (margin.abs() > U - 0.1).all(), margin  # +-8: no bias or sa_margin in these benchmarks moves them
        assert torch.equal(table[:, layer] == 0, fa[layer].expand(len(lens), -1)), (layer, table[:, layer])
