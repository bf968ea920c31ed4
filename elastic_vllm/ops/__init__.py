"""The Triton kernels, one folder per operator (flash-linear-attention's layout): the Triton kernel and its host
launcher (``kernel.py``: checks shapes, dtypes and strides, then one launch) beside a short plain-PyTorch reference
(``naive.py``) it is tested against:

    prefill/        varlen hybrid FA/SSA/XA prefill over a paged KV cache, one launch for every head
    decode/         one-token decode, per-head FA/SSA, split-KV plus a merge kernel
    route/          the Attention Router from the paged cache into the routing table
    xattn_select/   XAttention block selection (the XA heads' prefill metadata)
    _attn.py        the online-softmax tile loop prefill and decode share
    _common.py      the launchers' argument checks and device facts

The naive references read the paged cache through the shared oracle, ``elastic_vllm.reference``. Importing this
package, an operator's package or a ``naive`` module imports no Triton and compiles nothing; the ``kernel`` modules
import Triton. ``AVAILABLE`` / ``require`` are the one check the integrations make before importing them. Variants
tried and rejected, with their numbers: README.md here.
"""

from __future__ import annotations

import importlib.util


def unavailable_reason() -> str | None:
    """Why the kernels cannot load here (None when they can): Triton is not installed."""
    return None if importlib.util.find_spec("triton") is not None else "triton is not installed"


AVAILABLE = unavailable_reason() is None


def require(what: str) -> None:
    """Raise RuntimeError naming ``what`` needs the kernels and why they cannot load here."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(
            f"elastic: {what} needs the Triton kernels of elastic_vllm.ops, which cannot load here: {why}"
        )
