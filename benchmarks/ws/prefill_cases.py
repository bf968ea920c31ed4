#!/usr/bin/env python3
# ruff: noqa: E402  (the parent part imports nothing heavy; the case part imports torch after it)
"""csrc/prefill_ws.py's kernel on the GPU with and without warp specialization, each case in its own process
(8K tokens unless named, 32 q / 8 KV heads, d 128, bf16, block size 128), against the pointer kernel.

    GIT_COMMIT=<sha> python3 benchmarks/ws/prefill_cases.py --out benchmarks/results/dev/ws-prefill-2-h200.json

Cases: nows_fa (WS off: the program logic), ws_fa (WS), ws_fa_shift (seq_len not a multiple of 128), ws_ssa (all
heads SSA), ws_n1 (128 tokens), launcher_ssa_shift (through prefill_attention(use_ws=True)). The first run
(dev/ws-prefill-h200.json, c9d1bc1's kernel) also had ws_fa_qhost (Q through a host descriptor: it hung),
ws_fa_kvdev (K/V through device-side descriptors) and ws_fa_exact_tiles (no spare programs); the kernel has
since fixed Q device-side and K/V host-side, and launches through ``prefill._launch_ws``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _isolated import is_parent, run_cases

CASES = ["nows_fa", "ws_fa", "ws_fa_shift", "ws_ssa", "ws_n1", "launcher_ssa_shift"]
if __name__ == "__main__" and is_parent():
    run_cases(__file__, "prefill_ws kernel cases (benchmarks/ws/prefill_cases.py)", "case", CASES, 40,
              env={"CUDA_LAUNCH_BLOCKING": "1"})  # fmt: skip
    sys.exit(0)
from _gpu_common import bootstrap

bootstrap()
import torch
from elastic_vllm.csrc import prefill as P

case = sys.argv[2]
dev = torch.device("cuda")
S = 128 if case == "ws_n1" else 8192 - (37 if "shift" in case else 0)
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
    P.prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048, out=out, use_ws=True)
else:
    P._launch_ws(q, kc, vc, out, bt, qsl, sl, hm, None, 128, 2048, d**-0.5, BM, BN, 4, 2, "long_first",
                 ws=not case.startswith("nows"))  # fmt: skip
torch.cuda.synchronize()
ref = P.prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048)
print(json.dumps({"max_abs_err": float((out.float() - ref.float()).abs().max()), "nan": bool(out.isnan().any())}))
