"""The Attention Router from the paged cache into the routing table (the fused router kernel).

``kernel.py``: the Triton kernel and its host launcher (imports Triton); ``naive.py``: the plain-PyTorch
reference it is tested against.
"""
