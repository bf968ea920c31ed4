"""Triton kernels of elastic-vllm (installed as ``elastic_vllm.csrc``).

One module per operator, each with a host launcher that checks shapes, dtypes and strides,
and a plain-PyTorch reference in ``elastic_vllm.reference``:

- ``elastic_vllm.csrc.prefill.prefill_attention``: varlen hybrid FA/SSA/XA prefill over a paged
  KV cache, one launch for all heads
- ``elastic_vllm.csrc.decode.decode_attention``: one-token decode, per-head FA/SSA, split-KV
- ``elastic_vllm.csrc.route.route``: the Attention Router from the paged cache into a decision table
- ``elastic_vllm.csrc.xattn_select.xattn_select``: XAttention block selection (prefill metadata)

Importing this package imports nothing else and compiles nothing. Variants tried and rejected, with their
numbers: csrc/README.md.
"""
