#!/usr/bin/env python3
"""Accuracy of Elastic Attention vs dense, static-hybrid and streaming baselines (RULER + robust tasks).

    python3 benchmarks/accuracy.py --model DIR --router DIR --lengths 4096 8192 --samples 20 \\
        --out benchmarks/results/accuracy_smollm2 [--device cuda] [--methods ...] [--quick]

The harness lives in ``elastic_vllm.eval.harness`` (also ``elastic-vllm eval``); the prompts in
``elastic_vllm/eval/data/`` (built by ``python3 -m elastic_vllm.eval.prepare``). Runs from a plain checkout
(``_harness`` puts the repository root on sys.path).
"""

import sys

import _harness  # noqa: F401  (this checkout's package first on sys.path, its kernels included)

from elastic_vllm.eval.harness import main

if __name__ == "__main__":
    sys.exit(main())
