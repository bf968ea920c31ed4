"""Hybrid FA/SSA/XA causal prefill for a varlen batch over a paged KV cache, one launch for every head.

``kernel.py``: the Triton kernel and its host launcher (imports Triton); ``naive.py``: the plain-PyTorch
reference it is tested against.
"""
