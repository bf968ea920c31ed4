"""Shared helpers of the kernel tests (CPU, TRITON_INTERPRET=1; tests/conftest.py sets it)."""

from __future__ import annotations

import contextlib

import torch

from elastic_vllm.reference.paged import PagedBatch

# (atol, rtol) of a kernel output against the float32 reference computed from the same inputs.
# fp32: exact products, only the summation order differs. fp16: P is rounded to fp16 before the
# P.V product (as every flash kernel does): ~2^-11 relative per term.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3)}


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    atol, rtol = TOL[out.dtype]
    assert not torch.isnan(out).any(), f"{what}: NaN in output (an element was not written)"
    err = (out.float() - ref.float()).abs()
    bound = atol + rtol * ref.float().abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {out.numel()} elements off, max err {err.max().item():.3g} "
        f"(dtype {out.dtype}, atol {atol}, rtol {rtol}) at {tuple(torch.nonzero(bad)[0].tolist())}"
    )


def strided_caches(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cache contents as views of one [num_blocks, 2, block_size, H, D] tensor (non-contiguous)."""
    kv = torch.stack([batch.key_cache, batch.value_cache], dim=1).contiguous()
    return kv[:, 0], kv[:, 1]


def random_modes(B: int, hkv: int, modes: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """[B, Hkv] int8 head modes drawn from ``modes``; every mode appears when B * Hkv allows."""
    flat = torch.tensor(modes, dtype=torch.int8).repeat((B * hkv) // len(modes) + 1)[: B * hkv]
    return flat[torch.randperm(B * hkv, generator=gen)].view(B, hkv)


@contextlib.contextmanager
def no_host_sync():
    """Fail on any device->host read of a tensor (what a CUDA-graph capture would forbid)."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(n):
        def f(self, *a, **k):
            raise AssertionError(f"host sync: Tensor.{n} called inside a launcher")

        return f

    try:
        for n in names:
            setattr(torch.Tensor, n, boom(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
