#!/usr/bin/env python3
"""Why does the prefill kernel take longer inside vLLM than alone?

    GIT_COMMIT=<sha> python3 benchmarks/kernels_prefill_vllm.py [--out PATH] [--sections NAME,...]

Inside vLLM at 32K / Omega_MSR 0.75 the kernel took 7.65 ms per layer (two 16K chunks, e2e-vllm-h200-llama.json's
profile) where the single call takes 6.14 ms. Two sections, each against the single call over two cache planes:
  layout + chunks  (a) the elastic backend's own cache layout in vLLM, [blocks, bs, Hkv, 2d] with K and V
                   interleaved per (token, head); (b) the prompt in 16K chunks, each over every key so far
                   (chunked prefill, vLLM's default); (c) both
  context          (a) the queries as a strided view of a fused qkv tensor, as vLLM splits it; (b) each call
                   right after the layer's four linear layers for a 16K-token step (Llama-3.1-8B shapes), the
                   attention alone timed by events; (c) both. SDPA flash (dense) under (b) is the control: a
                   clock or L2 effect shows in any kernel, a layout effect only in ours.
The correctness gate runs first (benchmarks/_kernel_bench.py). ``--cpu-dry``: toy sizes under the interpreter.
"""

from __future__ import annotations

import sys

import torch
from _anchors import Anchors
from _harness import log
from _kernel_bench import HKV, HQ, KernelRun, main


def layout_section(run: KernelRun, S: int, d: int, shares, chunk: int) -> None:
    from elastic_vllm.ops.prefill.kernel import prefill_attention

    x = run.prefill_inputs(S, d)
    cfg = run.prefill_config(d)
    bs = cfg.pop("bs")
    kc, vc, bt = run.paged(x, bs)
    il = torch.cat([kc, vc], dim=-1)  # [blocks, bs, Hkv, 2d]: vLLM's layout for the elastic backend
    layouts = {"planes": (kc, vc), "vllm_interleaved": (il[..., :d], il[..., d:])}
    rows = run.rows("prefill_vllm")
    dev = run.dev
    for share in shares:
        hm = run.head_modes(share)
        flops = run.prefill_flops(S, d, share)
        ref = None
        for lay, (k, v) in layouts.items():
            for n_chunks in (1, S // chunk):
                out = torch.empty_like(x["q"])
                step = S // n_chunks
                calls = []
                for c in range(n_chunks):
                    q0, q1 = c * step, (c + 1) * step
                    calls.append((x["q"][q0:q1], torch.tensor([0, q1 - q0], device=dev, dtype=torch.int32),
                                  torch.tensor([q1], device=dev, dtype=torch.int32), out[q0:q1]))  # fmt: skip

                def fn(k=k, v=v, calls=calls, out=out, hm=hm):
                    for q, qsl, sl, o in calls:
                        prefill_attention(q, k, v, bt, qsl, sl, hm, sink=run.sink, window=run.window, out=o, **cfg)
                    return out

                o = fn().float()
                if ref is None:
                    ref = o.clone()
                r = run.timeit(fn)
                rows.append({"S": S, "d": d, "share": share, "layout": lay, "chunks": n_chunks, "bs": bs, **r,
                             "TFLOPs": flops / (r["ms"] * 1e-3) / 1e12,
                             "rel_diff_vs_first": float((o - ref).norm() / ref.norm())})  # fmt: skip
                log(rows[-1])
        run.save()
    del x, il


def context_section(run: KernelRun, anchors: Anchors, S: int, d: int, share: float, chunk: int) -> None:
    from elastic_vllm.ops.prefill.kernel import prefill_attention

    dev, dt = run.dev, run.dt
    x = run.prefill_inputs(S, d)
    cfg = run.prefill_config(d)
    bs = cfg.pop("bs")
    kc, vc, bt = run.paged(x, bs)
    il = torch.cat([kc, vc], dim=-1)
    k, v = il[..., :d], il[..., d:]
    qkv = torch.zeros(S, (HQ + 2 * HKV) * d, device=dev, dtype=dt)
    qkv[:, : HQ * d] = x["q"].reshape(S, HQ * d)
    q_strided = qkv[:, : HQ * d].view(S, HQ, d)
    hm = run.head_modes(share)
    n = S // chunk
    qsl = [torch.tensor([0, chunk], device=dev, dtype=torch.int32) for _ in range(n)]
    sl = [torch.tensor([(c + 1) * chunk], device=dev, dtype=torch.int32) for c in range(n)]

    def ours(q):
        out = torch.empty_like(x["q"])

        def fn():
            for c in range(n):
                q0, q1 = c * chunk, (c + 1) * chunk
                prefill_attention(q[q0:q1], k, v, bt, qsl[c], sl[c], hm, sink=run.sink, window=run.window,
                                  out=out[q0:q1], **cfg)  # fmt: skip
            return out

        return fn

    hid, inter = (4096, 14336) if run.cuda else (64, 128)
    t = chunk if run.cuda else 16
    xa = torch.randn(t, hid, device=dev, dtype=dt)
    xb = torch.randn(t, inter, device=dev, dtype=dt)
    ws = [torch.randn(hid, (HQ + 2 * HKV) * d, device=dev, dtype=dt), torch.randn(HQ * d, hid, device=dev, dtype=dt),
          torch.randn(hid, 2 * inter, device=dev, dtype=dt), torch.randn(inter, hid, device=dev, dtype=dt)]  # fmt: skip
    xq = torch.randn(t, HQ * d, device=dev, dtype=dt)

    def linears():
        for _ in range(n):  # one step per chunk: qkv, o, gate_up, down
            xa @ ws[0]
            xq @ ws[1]
            xa @ ws[2]
            xb @ ws[3]

    def idle():  # the control for "after linears": the same stream order, the GPU idle ~10 ms instead
        if run.cuda:
            torch.cuda._sleep(20_000_000)

    rows = run.rows("prefill_vllm_context")
    ref = ours(x["q"])().float()
    flops = run.prefill_flops(S, d, share)
    for name, q, pre in (("contiguous q", x["q"], None), ("strided q", q_strided, None),
                         ("contiguous q after idle", x["q"], idle), ("contiguous q after linears", x["q"], linears),
                         ("strided q after linears", q_strided, linears)):  # fmt: skip
        fn = ours(q)
        rel = float((fn().float() - ref).norm() / ref.norm())
        r = run.timed_after(fn, pre) if pre else run.timeit(fn)
        rows.append({"S": S, "share": share, "chunks": n, "bs": bs, "case": name, **r,
                     "TFLOPs": flops / (r["ms"] * 1e-3) / 1e12, "rel_diff_vs_first": rel})  # fmt: skip
        log(rows[-1])
    sdpa, _how = anchors.sdpa(x)
    for name, pre in (("sdpa flash dense", None), ("sdpa flash dense after idle", idle),
                      ("sdpa flash dense after linears", linears)):  # fmt: skip
        r = run.timed_after(sdpa, pre) if pre else run.timeit(sdpa)
        rows.append({"S": S, "case": name, **r, "TFLOPs": run.prefill_flops(S, d, 0.0) / (r["ms"] * 1e-3) / 1e12})
        log(rows[-1])


def sections(run: KernelRun) -> list:
    anchors = Anchors(run)
    S, ctx_S = run.size(32768, 256), run.size(32768, 128)
    shares = (0.75,) if run.cpu_dry else (0.0, 0.75)
    return [
        ("prefill vllm layout + chunks", lambda: layout_section(run, S, 128, shares, run.size(16384, 128))),
        ("prefill vllm context", lambda: context_section(run, anchors, ctx_S, 128, 0.75, run.size(16384, 64))),
    ]


def summary(run: KernelRun) -> None:
    for r in run.report.get("prefill_vllm", []):
        print(f"  prefill vllm S={r['S']} SA {r['share']:<4} {r['layout']:<16} chunks {r['chunks']} {r['ms']:8.2f} ms"
              f" {r['TFLOPs']:6.0f} TF/s rel {r['rel_diff_vs_first']:.1e}")  # fmt: skip
    for r in run.report.get("prefill_vllm_context", []):
        print(f"  prefill vllm context S={r['S']} {r['case']:<32} {r['ms']:8.2f} ms {r['TFLOPs']:6.0f} TF/s"
              f" rel {r.get('rel_diff_vs_first', 0):.1e}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(__doc__, [sys.modules[__name__]]))
