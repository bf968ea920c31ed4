#!/usr/bin/env python3
# ruff: noqa: E402  (the runner part imports nothing heavy; the case part imports torch after it)
"""csrc/prefill_ws.py's kernel on the GPU with and without warp specialization, each case in its own process
(8K tokens unless named, 32 q / 8 KV heads, d 128, bf16, block size 128), against the pointer kernel.

    GIT_COMMIT=<sha> python3 benchmarks/ws/prefill_cases.py --out benchmarks/results/dev/ws-prefill-h200.json

Cases: nows_fa (WS off: the program logic), ws_fa (WS, Q through a device-side descriptor), ws_fa_qhost (Q through
a host descriptor: hangs), ws_fa_kvdev (K/V device-side too), ws_fa_exact_tiles (no spare programs), ws_fa_shift
(seq_len not a multiple of 128), ws_ssa (all heads SSA), ws_n1 (128 tokens), launcher_ssa_shift (through
prefill_attention(use_ws=True)).
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))
CASES = ["nows_fa", "ws_fa", "ws_fa_kvdev", "ws_fa_exact_tiles", "ws_fa_shift", "ws_ssa", "ws_n1",
         "launcher_ssa_shift", "ws_fa_qhost"]  # fmt: skip
if __name__ == "__main__" and (len(sys.argv) == 1 or sys.argv[1] == "--out"):
    from _gpu_common import env_info, write_json

    out = sys.argv[2] if len(sys.argv) > 2 else None
    report = {"what": "prefill_ws kernel cases (benchmarks/ws/prefill_cases.py)", "env": env_info(), "rows": []}
    for c in sys.argv[3:] or CASES:
        try:
            p = subprocess.run([sys.executable, __file__, "--case", c], capture_output=True, text=True, timeout=40,
                               env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})  # fmt: skip
            last = (p.stdout.strip().splitlines() or ["{}"])[-1]
            row = json.loads(last) if p.returncode == 0 else {"error": (p.stderr.strip().splitlines() or [""])[-1]}
        except subprocess.TimeoutExpired:
            row = {"error": "timeout (hang)"}
        report["rows"].append({"case": c, **row})
        print(report["rows"][-1], flush=True)
        write_json(out, report)
    sys.exit(0)
from _gpu_common import bootstrap

bootstrap()
import torch
import triton
from elastic_vllm.csrc import prefill as P
from elastic_vllm.csrc.prefill_ws import _prefill_ws_kernel
from triton.tools.tensor_descriptor import TensorDescriptor

case = sys.argv[2]
dev = torch.device("cuda")
S = 8192 - (37 if "shift" in case else 0)
if case == "ws_n1":
    S = 128
hq, hkv, d, bs = 32, 8, 128, 128
g = torch.Generator(device="cpu").manual_seed(0)
nb = S // bs + 2
kc = torch.randn(nb, bs, hkv, d, generator=g).to(dev, torch.bfloat16)
vc = torch.randn(nb, bs, hkv, d, generator=g).to(dev, torch.bfloat16)
bt = torch.arange(1, nb, dtype=torch.int32, device=dev)[None]
q = torch.randn(S, hq, d, generator=g).to(dev, torch.bfloat16)
qsl = torch.tensor([0, S], dtype=torch.int32, device=dev)
sl = torch.tensor([S], dtype=torch.int32, device=dev)
hm = torch.full((1, hkv), 1 if "ssa" in case else 0, dtype=torch.int8, device=dev)
out = torch.full_like(q, float("nan"))
BM = BN = 128
if case.startswith("launcher"):
    os.environ["ELASTIC_WS_Q_DEVICE"] = "1"
    P.prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048, out=out, use_ws=True)
    torch.cuda.synchronize()
    ref = P.prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048)
    print(json.dumps({"max_abs_err": float((out.float() - ref.float()).abs().max()), "nan": bool(out.isnan().any())}))
    sys.exit(0)
qdev = "qhost" not in case
kvdev = "kvdev" in case
P._ensure_allocator(dev)
n_tiles = triton.cdiv(S, BM) + (0 if "exact" in case else 1)
_prefill_ws_kernel[(n_tiles * hq,)](
    q if qdev else TensorDescriptor(q, [S, hq * d], [q.stride(0), 1], [BM, d]),
    kc if kvdev else P._ws_descriptor(kc, BN),
    vc if kvdev else P._ws_descriptor(vc, BN),
    S,
    q.stride(0),
    nb,
    kc.stride(0),
    kc.stride(1),
    vc.stride(0),
    vc.stride(1),
    out,
    bt,
    qsl,
    sl,
    hm,
    sl,
    *out.stride()[:2],
    kc.stride(2),
    vc.stride(2),
    bt.stride(0),
    *hm.stride(),
    1,
    hkv,
    n_tiles,
    128,
    2048,
    d**-0.5 * 1.4426950408889634,
    G=hq // hkv,
    BLOCK_M=BM,
    BLOCK_N=BN,
    BS=bs,
    HEAD_DIM=d,
    HAS_SLOTS=False,
    FA_FIRST=True,
    BLOCK_H=8,
    SEARCH_STEPS=0,
    WS=not case.startswith("nows"),
    Q_ON_DEVICE=qdev,
    KV_ON_DEVICE=kvdev,
    num_warps=4,
    num_stages=2,
)
torch.cuda.synchronize()
ref = P.prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048)
print(json.dumps({"max_abs_err": float((out.float() - ref.float()).abs().max()), "nan": bool(out.isnan().any())}))
