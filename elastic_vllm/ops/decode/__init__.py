"""One-token decode over a paged KV cache, per-(request, KV head) FA or SSA, split-KV with a merge kernel.

``kernel.py``: the Triton kernel and its host launcher (imports Triton); ``naive.py``: the plain-PyTorch
reference it is tested against.
"""
