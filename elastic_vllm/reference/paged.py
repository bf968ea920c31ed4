"""Build test/benchmark batches in vLLM's paged layout, with randomly permuted blocks.

Block 0 is reserved (never used by a request), as vLLM reserves its null block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per request contiguous [S_b, Hkv, D]
    values: list[torch.Tensor]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def query_lens(self) -> list[int]:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random q/k/v for requests with ``seq_lens`` tokens in cache, the last ``query_lens`` of them queried."""
    if len(seq_lens) != len(query_lens):
        raise ValueError("seq_lens and query_lens differ in length")
    for s, q in zip(seq_lens, query_lens):
        if not 0 <= q <= s:
            raise ValueError(f"query_len {q} not in [0, seq_len {s}]")
    g = generator
    nblk = [(s + block_size - 1) // block_size for s in seq_lens]
    total = sum(nblk) + spare_blocks + 1
    perm = torch.randperm(total - 1, generator=g) + 1  # block 0 reserved
    kc = torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    max_blocks = max(nblk) if nblk else 1
    bt = torch.zeros(len(seq_lens), max(max_blocks, 1), dtype=torch.int32)
    keys, values = [], []
    at = 0
    for b, (s, n) in enumerate(zip(seq_lens, nblk)):
        ids = perm[at : at + n]
        at += n
        bt[b, :n] = ids.to(torch.int32)
        pos = torch.arange(s)
        keys.append(kc[ids[pos // block_size].long(), pos % block_size].clone())
        values.append(vc[ids[pos // block_size].long(), pos % block_size].clone())
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    q = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=g).to(dtype)
    dev = torch.device(device)
    return PagedBatch(
        q=q.to(dev),
        key_cache=kc.to(dev),
        value_cache=vc.to(dev),
        block_table=bt.to(dev),
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        keys=[k.to(dev) for k in keys],
        values=[v.to(dev) for v in values],
    )


def make_paged(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    block_size: int,
    generator: torch.Generator | None = None,
    spare_blocks: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter per-request [S_b, Hkv, D] keys/values into a randomly permuted paged cache (on their device).

    Returns key_cache, value_cache [num_blocks, block_size, Hkv, D] (views of one
    [num_blocks, 2, block_size, Hkv, D] tensor, like vLLM's) and block_table [B, max_blocks] int32.
    """
    dev = keys[0].device
    hkv, d = keys[0].shape[1:]
    nblk = [math.ceil(k.shape[0] / block_size) for k in keys]
    total = sum(nblk) + spare_blocks + 1
    perm = torch.randperm(total - 1, generator=generator, device="cpu").to(dev) + 1  # block 0 reserved
    kv = torch.zeros(total, 2, block_size, hkv, d, device=dev, dtype=keys[0].dtype)
    bt = torch.zeros(len(keys), max(max(nblk), 1), device=dev, dtype=torch.int32)
    at = 0
    for b, (k, v, n) in enumerate(zip(keys, values, nblk)):
        ids = perm[at : at + n]
        at += n
        bt[b, :n] = ids.to(torch.int32)
        pos = torch.arange(k.shape[0], device=dev)
        kv[ids[pos // block_size], 0, pos % block_size] = k
        kv[ids[pos // block_size], 1, pos % block_size] = v
    return kv[:, 0], kv[:, 1], bt
