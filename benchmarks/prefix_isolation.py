"""Prefix-cache hit rate under per-mode cache salts, on `elastic-vllm serve` with the demo model.

Workload: documents of ``--prefix`` tokens, each followed by ``--suffix``-token questions; the requests of a
document run one after the other in a seeded random order, each with its routing mode (no client salt).
A mix says how many requests of each mode one document gets; every mix has documents of its own, so the
mixes do not share blocks. The hit rate is vLLM's: delta ``vllm:prefix_cache_hits_total`` / delta
``vllm:prefix_cache_queries_total`` (tokens) over the mix.

A request reuses only blocks computed under its own mode, so a mix with overrides loses the hits
that crossed modes; ``auto``-only traffic keeps every hit. Run it once with the tree under test and once
with an older checkout first on PYTHONPATH (``--repo``) to compare.

    python3 benchmarks/prefix_isolation.py --out benchmarks/results/prefix-isolation-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from _harness import ROOT, environment, write_json

MIXES = {  # name -> requests of each mode per document
    "auto only": {"auto": 10},
    "80% auto, 10% all-FA, 10% all-SA": {"auto": 8, "all-FA": 1, "all-SA": 1},
    "a third each": {"auto": 3, "all-FA": 3, "all-SA": 3},
}
ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "256M", "--max-model-len", "2048"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", help="checkout whose elastic_vllm the server runs (default: this one)")
    ap.add_argument("--docs", type=int, default=2, help="documents per mix")
    ap.add_argument("--prefix", type=int, default=1024, help="document tokens shared by its requests")
    ap.add_argument("--suffix", type=int, default=64, help="question tokens of each request")
    ap.add_argument("--out", help="write the figures here (JSON)")
    a = ap.parse_args()

    import httpx

    from elastic_vllm.models import fetch_demo_model
    from elastic_vllm.server import ServeProcess, metric_value

    repo = Path(a.repo or ROOT).resolve()
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    env = {"PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    rng = random.Random(0)
    rows = []
    with ServeProcess(fetch_demo_model(), elastic={"sink": 16, "window": 64}, args=ARGS, env=env,
                      served_name="smollm2") as srv, httpx.Client(base_url=srv.base, timeout=600) as c:  # fmt: skip
        srv.wait_ready(900)
        for name, counts in MIXES.items():
            m0 = srv.metrics()
            t0 = time.time()
            for _ in range(a.docs):
                doc = [rng.randrange(100, 49_000) for _ in range(a.prefix)]
                modes = [m for m, n in counts.items() for _ in range(n)]
                rng.shuffle(modes)
                for mode in modes:
                    body = {"model": "smollm2", "prompt": doc + [rng.randrange(100, 49_000) for _ in range(a.suffix)],
                            "max_tokens": 1, "vllm_xargs": {"elastic_force": mode}}  # fmt: skip
                    r = c.post("/v1/completions", json=body)
                    r.raise_for_status()
            m1 = srv.metrics()
            hits = metric_value(m1, "vllm:prefix_cache_hits_total") - metric_value(m0, "vllm:prefix_cache_hits_total")
            queries = metric_value(m1, "vllm:prefix_cache_queries_total") - metric_value(
                m0, "vllm:prefix_cache_queries_total"
            )
            rows.append({"mix": name, "requests_per_doc": counts, "docs": a.docs, "hit_tokens": hits,
                         "query_tokens": queries, "hit_rate": round(hits / queries, 4), "seconds": round(time.time() - t0, 1)})  # fmt: skip
            print(f"{name:<36} hit rate {hits / queries:.3f} ({hits:.0f} / {queries:.0f} tokens)", file=sys.stderr)
    # "commit": the checkout the server ran (--repo), env.git_commit: this script's
    report = {"repo": str(repo), "commit": commit.stdout.strip(), "prefix": a.prefix, "suffix": a.suffix, "mixes": rows,
              "env": environment(("torch", "vllm"))}  # fmt: skip
    print(json.dumps(report, indent=1))
    write_json(a.out, report)


if __name__ == "__main__":
    main()
