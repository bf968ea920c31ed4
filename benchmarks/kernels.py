#!/usr/bin/env python3
"""Kernel benchmarks: the correctness gate, then every question of the kernel benchmark files, in one run on one GPU.

    GIT_COMMIT=<sha> python3 benchmarks/kernels.py [--out PATH] [--quick] [--sections NAME,...] [--cpu-dry]

The registry of the kernel questions, each a file that also runs alone with the same options:

    kernels_prefill.py       the hybrid prefill kernel vs SDPA / FlexAttention / split / vLLM's FA3
    kernels_prefill_vllm.py  the prefill kernel in vLLM's cache layout, chunks and context
    kernels_decode.py        sparse vs dense decode, TB/s against the copy bandwidth
    kernels_router.py        the fused router for 32 layers, eager and from a CUDA graph
    kernels_xattn.py         XAttention's selection and the attention over it, per mode

Setup, inputs and the gate: _kernel_bench.py; the anchors: _anchors.py; the tile and split sweeps that chose the
kernels' defaults: tools/tune_kernels.py. One JSON (GPU, torch/triton versions, commit from $GIT_COMMIT), written
after every measurement; ``--sections`` (name filters) and ``--quick`` split the grid over device calls
(``tools/gpu_session.sh kernels`` with SECTIONS / QUICK). On an H200 the whole grid takes ~7 min, compiles included.
"""

from __future__ import annotations

import sys

import kernels_decode
import kernels_prefill
import kernels_prefill_vllm
import kernels_router
import kernels_xattn
from _kernel_bench import main

QUESTIONS = (kernels_prefill, kernels_prefill_vllm, kernels_decode, kernels_router, kernels_xattn)

if __name__ == "__main__":
    sys.exit(main(__doc__, QUESTIONS))
