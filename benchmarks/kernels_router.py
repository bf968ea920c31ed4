#!/usr/bin/env python3
"""What does routing one request cost, for all 32 layers of an 8B-shaped model?

    GIT_COMMIT=<sha> python3 benchmarks/kernels_router.py [--out PATH] [--sections NAME,...]

The fused router (two launches per layer: task MLP over the pooled boundary keys, then the router MLP) for 8 KV
heads, head_dim 128, prompts of 8K and 128K tokens, 1 and 8 requests per step: eager and replayed from a CUDA graph
(what vLLM's prefill step pays), with and without programmatic dependent launch, and each launch alone.
The correctness gate runs first (benchmarks/_kernel_bench.py). ``--cpu-dry``: toy sizes under the interpreter.
"""

from __future__ import annotations

import functools
import math
import sys

import torch
from _harness import log
from _kernel_bench import BS, HKV, KernelRun, kernel_resources, main


def route_all_layers(router, kc, bts, rows, plen, slots, stages=("task", "router")) -> None:
    for layer, bt in enumerate(bts):
        router(kc, bt, rows, plen, slots, layer, stages=stages)


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def router_section(run: KernelRun) -> None:
    from elastic_vllm.ops.route.kernel import Router, _route_router_kernel, _route_task_kernel, pack_router_weights
    from elastic_vllm.router.model import ElasticRouter

    L, d, dev = 32, 128, run.dev
    torch.manual_seed(0)
    w = pack_router_weights(ElasticRouter(L, d)).to(dev)
    inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(dev)
    rows = run.rows("router")
    for S, R in [(8192, 1), (131072, 1), (8192, 8)] if run.cuda else [(512, 1)]:
        nblk = math.ceil(S / BS)
        # one cache per layer would be 32 x S tokens; layers share one cache through different block tables
        kc = torch.randn(nblk + 1, BS, HKV, d, device=dev, dtype=run.dt)
        bts = [(torch.randperm(nblk, device=dev) + 1).to(torch.int32)[None].expand(R, -1) for _ in range(L)]
        req = torch.arange(R, device=dev, dtype=torch.int32)
        plen = torch.full((R,), S, device=dev, dtype=torch.int32)
        table = torch.zeros(R, L, HKV, device=dev, dtype=torch.int8)
        router = Router(w, table, inv_freq=inv, num_kv_heads=HKV, head_dim=d, block_size=BS)
        all_layers = functools.partial(route_all_layers, router, kc, bts, req, plen, req)
        row = {"prompt": S, "requests": R, "layers": L, "launches_per_layer": 2, "eager": run.timeit(all_layers),
               "slices": [router.ns1, router.ns2]}  # fmt: skip
        if run.cuda:
            row["graph"] = run.timeit(graphed(all_layers).replay)
            row["graph_us_per_layer"] = row["graph"]["ms"] * 1e3 / L
            row["pdl"] = router.pdl
            if router.pdl:  # the same graph with launch 2 as an ordinary launch
                plain = Router(w, table, inv_freq=inv, num_kv_heads=HKV, head_dim=d, block_size=BS, pdl=False)
                row["graph_no_pdl"] = run.timeit(
                    graphed(functools.partial(route_all_layers, plain, kc, bts, req, plen, req)).replay
                )
            for name, kern in (("task", _route_task_kernel), ("router", _route_router_kernel)):
                row[f"{name}_kernel"] = kernel_resources(kern)
                one = functools.partial(route_all_layers, router, kc, bts, req, plen, req, stages=(name,))
                row[f"graph_{name}_only_us_per_layer"] = run.timeit(graphed(one).replay)["ms"] * 1e3 / L
        rows.append(row)
        log(row)
        run.save()


def sections(run: KernelRun) -> list:
    return [("router", lambda: router_section(run))]


def summary(run: KernelRun) -> None:
    for r in run.report.get("router", []):
        g = r.get("graph", {}).get("ms")
        print(f"  router prompt={r['prompt']} R={r['requests']} eager {r['eager']['ms']:.3f} ms graph {g} ms"
              f" task-only {r.get('graph_task_only_us_per_layer')} us/layer router-only"
              f" {r.get('graph_router_only_us_per_layer')} us/layer")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(__doc__, [sys.modules[__name__]]))
