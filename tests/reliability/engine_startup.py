"""Run as a script: start one real in-process vLLM engine (the demo model, elastic backend) per bad
startup configuration and write, per case, the exception it raised, as JSON.

    python tests/reliability/engine_startup.py MODEL CONFIGS.json OUT.json

CONFIGS.json maps a case name to its additional_config. One process imports vLLM once and builds
every engine in turn (VLLM_ENABLE_V1_MULTIPROCESSING=0), which costs a few seconds per case instead
of the ~70 CPU-seconds of a `vllm serve` start.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(model: str, configs_path: str, out_path: str) -> None:
    from vllm import LLM

    configs = json.loads(open(configs_path).read())
    results = {}
    for name, additional in configs.items():
        t0 = time.time()
        try:
            llm = LLM(
                model,
                attention_backend="elastic",
                additional_config=additional,
                dtype="float32",
                enforce_eager=True,
                kv_cache_memory_bytes=32 << 20,
                max_model_len=256,
            )
        except Exception as e:
            results[name] = {
                "error": type(e).__name__,
                "message": str(e),
                "seconds": round(time.time() - t0, 1),
                "traceback": traceback.format_exc()[-3000:],
            }
        else:  # started: the case was not refused
            results[name] = {"error": None, "message": "engine started", "seconds": round(time.time() - t0, 1)}
            llm.llm_engine.engine_core.shutdown()
            del llm
        with open(out_path, "w") as f:  # written after every case: a crash still leaves the earlier ones
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
