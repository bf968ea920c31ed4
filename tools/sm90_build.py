#!/usr/bin/env python3
"""Build the csrc kernels for sm_90 without a GPU and report what the compiler made of them.

    python3 -m pip install --no-deps --target /tmp/t36 triton==3.6.0   # the GPU machine's Triton
    PYTHONPATH=/tmp/t36 python3 tools/sm90_build.py --out benchmarks/results/experiments/sm90-build.json

A fake active driver reports an sm_90 target; the launchers run with CPU tensors and ``warmup=True`` (compile,
no launch). From each cubin, with the cuobjdump that Triton ships: registers, stack bytes (spills live there)
and the global loads by width (LDG.E = 4 bytes, LDG.E.128 = 16 bytes). Rows: the prefill kernel at block
size 16 and 128 and the tune candidate with 64 x 64 tiles (Llama-3.1-8B attention shape); the two router kernels with
packed weight rows padded (``pack_router_weights``) and unpadded (``router_param_count`` floats), with the
order of their loads and barriers (``schedule``); the decode split and merge kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Sm90(CudaDriver):
    def __init__(self):  # no CUDA library needed: nothing is launched
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _capture(*jit_fns):
    """Make each JITFunction compile only (warmup) and keep the last compiled kernel per name."""
    got = {}
    for fn in jit_fns:
        run = fn.run

        def wrapped(*a, _run=run, _name=fn.__name__, **k):
            k["warmup"] = True
            got[_name] = _run(*a, **k)
            return got[_name]

        fn.run = wrapped
    return got


def _resources(kernel) -> dict:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    loads = collections.Counter(re.findall(r"\b(?:LDGSTS|LDG)(?:\.[A-Z0-9_]+)*\b", sass))
    return {
        "registers": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", res).group(1)),
        "global_loads": dict(sorted(loads.items())),
        "schedule": _schedule(sass),
    }


def _schedule(sass: str) -> str:
    """Global loads, CTA barriers and grid-dependency instructions in program order, runs counted:
    "LDG x6, BAR x2, ..." shows whether loads wait behind barriers (each BAR after a load is a wait
    for that load's latency before the next loads issue). ACQBULK = griddepcontrol.wait,
    PREEXIT = griddepcontrol.launch_dependents."""
    runs: list[list] = []
    for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass):
        op = m.group(1).split(".")[0]
        op = {"LDGSTS": "LDGSTS", "LDG": "LDG", "BAR": "BAR", "ACQBULK": "ACQBULK", "PREEXIT": "PREEXIT"}.get(op)
        if op is None:
            continue
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return ", ".join(f"{op} x{n}" for op, n in runs)


def prefill_rows() -> list[dict]:
    from elastic_vllm.ops.prefill import kernel as P

    got = _capture(P._prefill_kernel)
    rows = []
    S, hq, hkv, d = 4096, 32, 8, 128
    for bs in (16, 128):
        nb = S // bs + 1
        kv = torch.empty(nb, 2, bs, hkv, d, dtype=torch.bfloat16)
        P.prefill_attention(
            torch.empty(S, hq, d, dtype=torch.bfloat16), kv[:, 0], kv[:, 1], torch.zeros(1, nb, dtype=torch.int32),
            torch.tensor([0, S], dtype=torch.int32), torch.tensor([S], dtype=torch.int32),
            torch.zeros(1, hkv, dtype=torch.int8), sink=128, window=2048,
            block_m=128, block_n=128, num_warps=8, num_stages=3,
        )  # fmt: skip
        rows.append({"kernel": "_prefill_kernel", "block_size": bs, "tiles": "128x128",
                     "num_warps": 8, "shared_bytes": got["_prefill_kernel"].metadata.shared,
                     **_resources(got["_prefill_kernel"])})  # fmt: skip
    # the tune candidate with two programs per SM (tools/tune_kernels.py TUNE_CANDIDATES): 64 x 64 tiles, 4 warps
    nb = S // 128 + 1
    kv = torch.empty(nb, 2, 128, hkv, d, dtype=torch.bfloat16)
    P.prefill_attention(
        torch.empty(S, hq, d, dtype=torch.bfloat16), kv[:, 0], kv[:, 1], torch.zeros(1, nb, dtype=torch.int32),
        torch.tensor([0, S], dtype=torch.int32), torch.tensor([S], dtype=torch.int32),
        torch.zeros(1, hkv, dtype=torch.int8), sink=128, window=2048,
        block_m=64, block_n=64, num_warps=4, num_stages=3,
    )  # fmt: skip
    k = got["_prefill_kernel"]
    rows.append({"kernel": "_prefill_kernel", "block_size": 128, "tiles": "64x64",
                 "num_warps": 4, "shared_bytes": k.metadata.shared, **_resources(k)})  # fmt: skip
    return rows


def router_rows() -> list[dict]:
    from elastic_vllm.ops import _common
    from elastic_vllm.ops.route import kernel as R
    from elastic_vllm.router.model import ElasticRouter

    got = _capture(R._route_task_kernel, R._route_router_kernel)
    _common.pdl_supported = lambda device: True  # the fake sm_90 device: build what an H200 runs (launch 2 as PDL)
    L, d, hkv, bs, S = 32, 128, 8, 16, 8192
    padded = R.pack_router_weights(ElasticRouter(L, d))
    rows = []
    for name, w in (("padded", padded), ("unpadded", padded[:, : R.router_param_count(d, 4 * d)].contiguous())):
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
        router = R.Router(w, torch.zeros(1, L, hkv, dtype=torch.int8), inv_freq=inv, num_kv_heads=hkv, head_dim=d,
                          block_size=bs)  # fmt: skip
        kc = torch.empty(S // bs + 1, bs, hkv, d, dtype=torch.bfloat16)
        one = torch.zeros(1, dtype=torch.int32)
        router(kc, torch.zeros(1, S // bs, dtype=torch.int32), one, torch.full((1,), S, dtype=torch.int32), one, 1)
        for k in ("_route_task_kernel", "_route_router_kernel"):
            rows.append({"kernel": k, "weight_rows": name, "row_floats": w.shape[1], **_resources(got[k])})
    return rows


def decode_rows() -> list[dict]:
    """The split-KV decode kernel and its merge kernel (a programmatic dependent launch on sm_90) at 32K x 16."""
    from elastic_vllm.ops import _common
    from elastic_vllm.ops.decode import kernel as D

    got = _capture(D._decode_kernel, D._decode_merge_kernel)
    _common.pdl_supported = lambda device: True
    D.num_sms = lambda device: 132  # the H200's SM count: the split count the GPU would use
    B, hq, hkv, d, bs, ctx = 16, 32, 8, 128, 16, 32768
    kv = torch.empty(B * ctx // bs + 1, 2, bs, hkv, d, dtype=torch.bfloat16)
    D.decode_attention(
        torch.empty(B, hq, d, dtype=torch.bfloat16), kv[:, 0], kv[:, 1], torch.zeros(B, ctx // bs, dtype=torch.int32),
        torch.full((B,), ctx, dtype=torch.int32), torch.zeros(B, hkv, dtype=torch.int8), sink=128, window=2048,
        max_seq_len=ctx,
    )  # fmt: skip
    return [{"kernel": k, "block_size": bs, **_resources(got[k])} for k in ("_decode_kernel", "_decode_merge_kernel")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    driver.set_active(_Sm90())
    rows = prefill_rows() + router_rows() + decode_rows()
    commit = (
        os.environ.get("GIT_COMMIT")
        or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    report = {"what": "offline sm_90 builds (no GPU): registers, stack, global loads by width", "triton": triton.__version__,
              "target": "cuda sm_90", "git_commit": commit, "command": " ".join(sys.argv), "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1))
    for r in rows:
        print({k: v for k, v in r.items() if k != "kernel"}, r["kernel"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
