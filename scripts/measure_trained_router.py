#!/usr/bin/env python3
"""Measure a trained router: realized Omega_MSR per task (held-out mixture) and needle accuracy
with routing on versus every head FA, through the transformers engine.

    python scripts/measure_trained_router.py --model MODEL_DIR --router router_weights/smollm2-135m-instruct \
        --eval DATA/eval.jsonl.gz --lengths 2048,3072,4096,5120,6144 --per-length 20 --out measure.json

Runs on a GPU (bf16) when there is one, else on the CPU (float32; slow at 6K tokens). Prints a
markdown report and writes the full result as JSON. Targets (exit code stays 0; the report says
MET / NOT MET): robust Omega_MSR >= sensitive + 0.15; needle accuracy within 2 points of all-FA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPL3 = "/usr/share/common-licenses/GPL-3"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="transformers model folder")
    p.add_argument("--router", required=True, help="router checkpoint folder (router.json + router.safetensors)")
    p.add_argument("--eval", required=True, help="held-out mixture JSONL(.gz) (build-data's eval.jsonl.gz)")
    p.add_argument("--lengths", default="2048,3072,4096,5120,6144", help="needle prompt lengths in tokens")
    p.add_argument("--per-length", type=int, default=20, help="needle prompts per length (depths spread evenly)")
    p.add_argument("--haystack", default=GPL3 if os.path.isfile(GPL3) else "noise", help="'noise' or a text file")
    p.add_argument("--max-eval-tokens", type=int, default=8192)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--out", help="write the JSON result here")
    a = p.parse_args()

    from elastic_vllm.eval.router_eval import format_report, measure
    from elastic_vllm.train.data import read_jsonl

    res = measure(
        a.model,
        a.router,
        read_jsonl(a.eval),
        [int(x) for x in a.lengths.split(",")],
        a.per_length,
        a.haystack,
        a.device,
        a.dtype,
        a.max_eval_tokens,
    )
    res["haystack"] = str(a.haystack)
    import torch

    from elastic_vllm.eval.engine import provenance

    dev = torch.device("cuda" if torch.cuda.is_available() and not a.device.startswith("cpu") else "cpu")
    res["provenance"] = provenance([sys.executable, *sys.argv], dev)
    print(format_report(res))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
