"""Triton kernels of elastic-vllm (installed as ``elastic_vllm.csrc``).

One module per operator, each with a host launcher that checks shapes, dtypes and strides,
and a plain-PyTorch reference in ``elastic_vllm.reference``. Importing this package does not
compile anything.
"""
