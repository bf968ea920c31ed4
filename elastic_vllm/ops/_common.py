"""Shared host helpers of the kernels: argument checks, head-mode constants, device facts.

The head-mode values are those of ``elastic_vllm.config.HeadMode`` (FA=0, SSA=1, XA=2); they are
repeated here so that the kernels import nothing but torch and triton (tests check they agree).
"""

from __future__ import annotations

import functools
import os

import torch

MODE_FA = 0
MODE_SSA = 1
MODE_XA = 2

# "infinite" window of an FA head: FA is SSA with sink 0 and a window no sequence reaches
BIG_WINDOW = 1 << 30

INDEX_DTYPES = (torch.int32, torch.int64)
MODE_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret() -> bool:
    """True when Triton runs through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel's launch and prologue overlapping the previous kernel's
    tail, ``griddepcontrol``): sm_90+ CUDA, not under TRITON_INTERPRET. Used by the router's second launch
    and the decode merge kernel."""
    if device.type != "cuda" or interpret():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def resolve_pdl(pdl: bool | None, device: torch.device) -> bool:
    """A launcher's ``pdl`` argument: None = where supported; True where unsupported is a ValueError."""
    use = pdl_supported(device) if pdl is None else bool(pdl)
    if use and not pdl_supported(device):
        raise ValueError(f"pdl: programmatic dependent launch needs a CUDA device of capability >= 9.0, got {device}")
    return use


def check_tensor(
    t,
    name: str,
    *,
    dim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = False,
) -> None:
    """Raise ValueError naming ``name`` if t is not a tensor of the expected rank/dtype/shape/device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} not supported (expected {names})")
    if shape is not None:
        for i, (have, want) in enumerate(zip(t.shape, shape)):
            if want is not None and have != want:
                raise ValueError(f"{name}: dimension {i} is {have}, expected {want} (shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (all inputs on one device)")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a vLLM-layout paged cache pair; return (num_blocks, block_size, num_kv_heads, head_dim).

    Any strides are accepted (e.g. views of a [num_blocks, 2, block_size, H, D] tensor); only the
    head dimension must be contiguous.
    """
    check_tensor(key_cache, "key_cache", dim=4, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_tensor(
        value_cache,
        "value_cache",
        dim=4,
        dtypes=(key_cache.dtype,),
        shape=tuple(key_cache.shape),
        device=key_cache.device,
        last_contiguous=True,
    )
    nb, bs, hkv, d = key_cache.shape
    return nb, bs, hkv, d


def check_paged_batch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    head_modes: torch.Tensor,
    head_mode_slots: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int]:
    """The checks every attention launcher makes first: q [T, Hq, D] float, D contiguous; the paged cache
    (``value_cache`` None: keys only, as the XA selection reads them) on q's device in q's dtype, Hq a multiple of
    Hkv; seq_lens [B]; query_start_loc [B+1] (None: one query per request, B = T); block_table [B, max_blocks];
    head_modes [B, Hkv], or a [slots, Hkv] table read at head_mode_slots [B]. Returns (B, Hq, Hkv, D, block_size);
    a ValueError naming the argument otherwise."""
    check_tensor(q, "q", dim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    dev = q.device
    if value_cache is None:
        check_tensor(key_cache, "key_cache", dim=4, dtypes=(q.dtype,), device=dev, last_contiguous=True)
        _nb, bs, hkv, d = key_cache.shape
    else:
        _nb, bs, hkv, d = check_cache_pair(key_cache, value_cache)
        if key_cache.dtype != q.dtype:
            raise ValueError(f"key_cache: dtype {key_cache.dtype} differs from q's {q.dtype}")
        if key_cache.device != dev:
            raise ValueError(f"key_cache: on {key_cache.device}, expected {dev}")
    T, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q: head_dim {dq} differs from the cache's {d}")
    if hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of {hkv} KV heads")
    if query_start_loc is None:
        B = T
        check_tensor(seq_lens, "seq_lens", dim=1, dtypes=INDEX_DTYPES, shape=(B,), device=dev)
    else:
        B = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
        check_tensor(seq_lens, "seq_lens", dim=1, dtypes=INDEX_DTYPES, device=dev)
        check_tensor(query_start_loc, "query_start_loc", dim=1, dtypes=INDEX_DTYPES, shape=(B + 1,), device=dev)
    check_tensor(block_table, "block_table", dim=2, dtypes=INDEX_DTYPES, shape=(B, None), device=dev)
    if head_mode_slots is None:
        check_tensor(head_modes, "head_modes", dim=2, dtypes=MODE_DTYPES, shape=(B, hkv), device=dev)
    else:
        check_tensor(head_mode_slots, "head_mode_slots", dim=1, dtypes=INDEX_DTYPES, shape=(B,), device=dev)
        check_tensor(head_modes, "head_modes", dim=2, dtypes=MODE_DTYPES, shape=(None, hkv), device=dev)
    return B, hq, hkv, d, bs


def check_ssa(sink: int, window: int) -> None:
    if sink < 0 or window < 1:
        raise ValueError(f"sink/window: need sink >= 0 and window >= 1, got sink={sink} window={window}")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (a host property: no sync, cached)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a small pretend machine so split logic is exercised


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products (the fp32 paths are for checking); 16-bit use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"
