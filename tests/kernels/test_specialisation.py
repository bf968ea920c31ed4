"""Which launch arguments the Triton kernels specialise on.

Triton specialises an int argument on its divisibility by 16 unless it is listed in ``do_not_specialize``.
For the strides of q, o and the paged K / V cache that divisibility is what lets the compiler prove 16-byte
alignment of every row: with it the sm_90 build of the prefill kernel copies K / V tiles with 144 16-byte
cp.async (LDGSTS.128), without it with 448 2-byte loads, and the decode kernel spilled 5.5 KB (tools/sm90_build.py;
on the H200 the median inter-token latency of 1K-prompt serving went from 7.4 ms, serve-vs-flash-attn-h200.json at
cbcd92a, to 11.8 ms, experiments/serve-1k-h200-41a2f67.json). Those strides are
multiples of 16 in the engine and in the warm-up alike (head sizes 32-256), so specialising on them compiles no
extra variant. The block table's row stride follows max_model_len (the warm-up's differs from the engine's) and
must not be specialised, or the first long request compiles while serving.
"""

from __future__ import annotations

import pytest
from test_xattn_select import no_specialize

from elastic_vllm.ops.decode.kernel import _decode_kernel
from elastic_vllm.ops.prefill.kernel import _prefill_kernel
from elastic_vllm.ops.xattn_select.kernel import _xattn_select_kernel

DATA_STRIDES = {
    "_decode_kernel": (
        _decode_kernel,
        {"s_qb", "s_qh", "s_ob", "s_oh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh"},
    ),
    "_prefill_kernel": (
        _prefill_kernel,
        {"s_qt", "s_qh", "s_ot", "s_oh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh"},
    ),
    "_xattn_select_kernel": (_xattn_select_kernel, {"s_qt", "s_qh", "s_kb", "s_kt", "s_kh"}),
}


def _params(kernel) -> set[str]:
    fn = getattr(kernel, "fn", kernel)  # JITFunction or, under TRITON_INTERPRET=1, the interpreted wrapper
    fn = getattr(fn, "fn", fn)
    return set(fn.__code__.co_varnames[: fn.__code__.co_argcount])


@pytest.mark.parametrize("name", sorted(DATA_STRIDES))
def test_data_strides_specialised_block_table_stride_not(name):
    kernel, strides = DATA_STRIDES[name]
    assert strides <= _params(kernel), strides - _params(kernel)  # the names exist: the check is not vacuous
    off = no_specialize(kernel)
    assert not strides & off, f"{name}: {sorted(strides & off)} not specialised: no 16-byte loads"
    assert {"s_bt", "s_hm0"} <= off, f"{name}: the block table / head-mode row strides must not be specialised"
