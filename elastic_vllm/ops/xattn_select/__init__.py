"""XAttention block selection over a paged KV cache: the XA heads' prefill metadata.

``kernel.py``: the Triton kernel and its host launcher (imports Triton); ``naive.py``: the plain-PyTorch
reference it is tested against.
"""
