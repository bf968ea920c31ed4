#!/usr/bin/env python3
"""What do XAttention's block selection and the attention over its selection cost, per routing mode?

    GIT_COMMIT=<sha> python3 benchmarks/kernels_xattn.py [--out PATH] [--sections NAME,...]

At the Llama-8B shape as vLLM runs it: the prompt's last 16K queries over all S keys (the heaviest chunked-prefill
step) at S = 32K and 128K, block 128 (cache block size and XA block), stride 16. Per mode at Omega_MSR 0.75
(FA-SSA, FA-XA, XA-SSA) and all-XA / all-FA, at thresholds 0.9 and 0.3: the selection alone, the prefill kernel
alone with that selection, and both; the selected share of the causal blocks. Random q/k (like dummy weights)
give nearly uniform attention, so the 0.9-mass rule keeps most blocks: the worst case of XA's cost.
The correctness gate runs first (benchmarks/_kernel_bench.py). ``--cpu-dry``: toy sizes under the interpreter.
"""

from __future__ import annotations

import sys

import torch
from _harness import log
from _kernel_bench import HKV, KernelRun, kernel_resources, main, sa_heads

MODES = {"FA-SSA": (0, 1), "FA-XA": (0, 2), "XA-SSA": (2, 1), "all-XA": (2, 2), "all-FA": (0, 0)}


def xattn_section(run: KernelRun, S: int, chunk: int, thresholds=(0.9,)) -> None:
    from elastic_vllm.ops.prefill.kernel import prefill_attention
    from elastic_vllm.ops.xattn_select.kernel import xattn_max_blocks, xattn_select

    dev = run.dev
    x = run.prefill_inputs(S, 128)
    bs = 128 if run.cuda else 16
    xblock, stride = (128, 16) if run.cuda else (32, 8)
    kc, vc, bt = run.paged(x, bs)
    q = x["q"][S - chunk :]
    qsl = torch.tensor([0, chunk], device=dev, dtype=torch.int32)
    sl = torch.tensor([S], device=dev, dtype=torch.int32)
    mq, mk = xattn_max_blocks(chunk, S, xblock)
    sa = sa_heads(0.75)  # the SA heads of the share, as the prefill rows assign them
    modes = {name: [sa_mode if s else fa_mode for s in sa] for name, (fa_mode, sa_mode) in MODES.items()}
    q0 = S - chunk  # causal blocks of the chunk's query blocks: block a sees a + 1 key blocks
    causal = sum(a + 1 for a in range(q0 // xblock, (S - 1) // xblock + 1))
    rows = run.rows("xattn")
    out = torch.empty_like(q)
    for name, m in modes.items():
        hm = torch.tensor([m], device=dev, dtype=torch.int8)
        for thr in thresholds if 2 in m else (None,):

            def sel(hm=hm, thr=thr):
                return xattn_select(q, kc, bt, qsl, sl, hm, max_q_blocks=mq, max_k_blocks=mk, stride=stride,
                                    block=xblock, threshold=thr)  # fmt: skip

            def attn(idx=None, cnt=None, hm=hm):
                return prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=run.sink, window=run.window, out=out,
                                         xa_block_idx=idx, xa_block_cnt=cnt, xattn_block=xblock)  # fmt: skip

            row = {"S": S, "chunk": chunk, "mode": name, "threshold": thr, "bs": bs, "xa_block": xblock,
                   "stride": stride}  # fmt: skip
            if thr is None:
                row["attn"] = run.timeit(attn)
            else:
                idx, cnt = sel()
                xa = [h for h in range(HKV) if m[h] == 2]
                row["selected_share"] = float(cnt[0, xa].sum().item() / (len(xa) * causal))
                row["select"] = run.timeit(sel)
                row["attn"] = run.timeit(lambda idx=idx, cnt=cnt: attn(idx, cnt))
                row["both"] = run.timeit(lambda: attn(*sel()))
            rows.append(row)
            log(row)
            run.save()
    del x


def resources(run: KernelRun) -> None:
    from elastic_vllm.ops.prefill.kernel import _prefill_kernel
    from elastic_vllm.ops.xattn_select.kernel import _xattn_select_kernel

    run.report["xattn_kernels"] = {"select": kernel_resources(_xattn_select_kernel),
                                   "prefill": kernel_resources(_prefill_kernel)}  # fmt: skip


def sections(run: KernelRun) -> list:
    sizes = ((256, 128),) if run.cpu_dry else ((32768, 16384), (131072, 16384))
    out = [(f"xattn S={S}", lambda S=S, c=c: xattn_section(run, S, c, (0.9, 0.3))) for S, c in sizes]
    return [*out, ("xattn kernel variants", lambda: resources(run))]


def summary(run: KernelRun) -> None:
    for r in run.report.get("xattn", []):
        sel = r.get("select", {}).get("ms")
        print(f"  xattn S={r['S']} {r['mode']:<6} thr {r['threshold']} attn {r['attn']['ms']:.2f} ms select {sel}"
              f" share {r.get('selected_share')}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(__doc__, [sys.modules[__name__]]))
