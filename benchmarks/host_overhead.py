#!/usr/bin/env python3
"""Host (Python) time of the kernels' launchers per call, with the Triton launch itself stubbed out.

    python3 benchmarks/host_overhead.py --out benchmarks/results/host-overhead-cpu.json

vLLM runs the attention op eagerly between graph pieces at prefill, once per layer and step, so what the
launchers do on the host before the launch is paid 32x per step on an 8B model (the decode launch is
captured in CUDA graphs and replayed without it). Shapes: the Llama-3.1-8B attention (32 q / 8 KV heads,
d 128), an 8K prompt in vLLM's cache layout for the elastic backend ([blocks, 16, 8, 2 x 128] bf16, CPU
tensors: nothing is launched). Each launcher is called ``--calls`` times after a warm-up; the median of
``--repeats`` runs is reported. CPU numbers: the GPU machine's CPU runs the same Python faster. The kernels
come from this file's checkout (``_harness`` puts it first on sys.path), so copying the script into a worktree of
an older commit measures that commit. Run it on a quiet machine: a concurrent test run doubled the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from _harness import environment, write_json

os.environ.pop("TRITON_INTERPRET", None)  # the launchers' GPU-path config, not the interpreter's

import torch


class _NoLaunch:
    """Stands in for a JITFunction: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def _time(fn, calls: int, repeats: int) -> float:
    for _ in range(50):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs)


def _glue_rows(route, router, key_cache, L: int, hkv: int, d: int, bs: int, args) -> dict[str, float]:
    """One layer's routing of one prompt row in the engine, both ways: the per-layer torch glue
    (``route_layer`` with the Triton router, then ``RoutingTables.write``: ``EngineState.route``'s torch
    path) and the fused path (``TritonRouter.route_into``: the kernel writes
    the tables). Kernel launches stubbed as above."""
    from elastic_vllm.config import ElasticConfig
    from elastic_vllm.ops.route import kernel as route_kernel
    from elastic_vllm.reference.rope import RopeSpec
    from elastic_vllm.router.policy import RoutingTables
    from elastic_vllm.vllm_plugin import routing as R

    for n in ("_route_task_kernel", "_route_router_kernel", "_route_pool_kernel"):  # the plugin's import of them
        setattr(route_kernel, n, _NoLaunch())

    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    rope = RopeSpec(inv, 1.0, d, d)
    cfg = ElasticConfig()
    tr = R.TritonRouter(router, rope, L, hkv, 8, torch.device("cpu"))
    bt = torch.zeros(4, 8192 // bs, dtype=torch.int32)
    rb = R.build_route_batch([R.RouteRow(row=0, end=8192, force="auto", decode_phase=False, final_slot=1)], bt, bs,
                             "boundary", 100)  # fmt: skip
    tables = RoutingTables(
        torch.zeros(L, 8, hkv, dtype=torch.int32), torch.zeros(4, L, hkv, dtype=torch.int8),
        torch.zeros(4, L, hkv, dtype=torch.bool), torch.zeros(4, L, hkv, 2),
    )  # fmt: skip

    def torch_glue():
        logits, routing, pooled = R.route_layer(3, key_cache, rb, router, rope, cfg, hkv, tr)
        tables.write(3, rb.rows, rb.final_idx, rb.final_slots, routing, logits, pooled)

    return {
        "layer routing, torch glue (route_layer + table writes)": _time(torch_glue, args.calls // 4, args.repeats),
        "layer routing, fused (TritonRouter.route_into)": _time(
            lambda: tr.route_into(3, key_cache, rb, cfg, tables), args.calls // 4, args.repeats
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from elastic_vllm.ops.decode import kernel as decode
    from elastic_vllm.ops.prefill import kernel as prefill
    from elastic_vllm.ops.route import kernel as route
    from elastic_vllm.router.model import ElasticRouter

    for mod, names in ((prefill, ["_prefill_kernel"]), (decode, ["_decode_kernel", "_decode_merge_kernel"]),
                       (route, ["_route_task_kernel", "_route_router_kernel", "_route_pool_kernel"])):  # fmt: skip
        for n in names:
            setattr(mod, n, _NoLaunch())
    S, hq, hkv, d, bs, B = 8192, 32, 8, 128, 16, 16
    kv = torch.empty(S // bs + 1, bs, hkv, 2 * d, dtype=torch.bfloat16)
    k, v = kv[..., :d], kv[..., d:]
    q = torch.empty(S, hq, d, dtype=torch.bfloat16)
    bt = torch.zeros(1, S // bs, dtype=torch.int32)
    qsl, sl = torch.tensor([0, S], dtype=torch.int32), torch.tensor([S], dtype=torch.int32)
    hm, out = torch.zeros(1, hkv, dtype=torch.int8), torch.empty_like(q)
    rows = {}
    rows["prefill_attention"] = _time(
        lambda: prefill.prefill_attention(q, k, v, bt, qsl, sl, hm, sink=128, window=2048, out=out),
        args.calls, args.repeats,
    )  # fmt: skip
    qd = torch.empty(B, hq, d, dtype=torch.bfloat16)
    btd = torch.zeros(B, S // bs, dtype=torch.int32)
    sld, hmd = torch.full((B,), S, dtype=torch.int32), torch.zeros(B, hkv, dtype=torch.int8)
    rows["decode_attention"] = _time(
        lambda: decode.decode_attention(qd, k, v, btd, sld, hmd, sink=128, window=2048, max_seq_len=S, num_splits=1),
        args.calls, args.repeats,
    )  # fmt: skip
    L = 32
    w = route.pack_router_weights(ElasticRouter(L, d))
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    table = torch.zeros(1, L, hkv, dtype=torch.int8)
    r = route.Router(w, table, inv_freq=inv, num_kv_heads=hkv, head_dim=d, block_size=bs, pdl=False)
    one = torch.zeros(1, dtype=torch.int32)
    rows["Router.__call__ (2 launches)"] = _time(lambda: r(k, bt, one, sl, one, 3), args.calls, args.repeats)
    rows.update(_glue_rows(route, ElasticRouter(L, d), k, L, hkv, d, bs, args))
    env = environment(("torch",))
    report = {
        "what": "host Python time per launcher call (us), Triton launch stubbed out; median of repeats",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "env": env,
        "git_commit": env["git_commit"],
        "command": env["command"],
        "shape": {"S": S, "Hq": hq, "Hkv": hkv, "d": d, "block_size": bs, "decode_batch": B, "layers": L},
        "us_per_call": {k_: round(v_, 1) for k_, v_ in rows.items()},
    }
    print(json.dumps(report["us_per_call"]))
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
