"""Reference routing from a paged cache: the oracle of ``elastic_vllm.ops.route.kernel``.

Gathers each routed request's prompt keys (POST-RoPE, as the cache holds them), rotates them
back to pre-RoPE keys, pools them and runs the layer's router: the exact composition
``invert_rope -> pool_keys -> ElasticRouter.forward`` of the float32 reference modules.
"""

from __future__ import annotations

import torch

from elastic_vllm.reference.attention import gather_paged
from elastic_vllm.reference.rope import RopeSpec, invert_rope
from elastic_vllm.router.model import ElasticRouter, pool_keys


@torch.no_grad()
def route_logits_ref(
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    prompt_lens: torch.Tensor,
    router: ElasticRouter,
    layer: int,
    spec: RopeSpec,
    pooling: str = "boundary",
    pool_tokens: int = 100,
) -> torch.Tensor:
    """Router logits [R, Hkv, 2] (float32) of the routed requests at ``layer``; index 1 = FA."""
    out = []
    for row, n in zip(req_rows.tolist(), prompt_lens.tolist()):
        keys = gather_paged(key_cache, block_table[row], n)  # [n, Hkv, d] post-RoPE
        pre = invert_rope(keys, torch.arange(n, device=keys.device), spec)
        pooled = pool_keys(pre, pooling, pool_tokens)  # [Hkv, d]
        out.append(router(layer, pooled))
    return torch.stack(out)
