#!/usr/bin/env python3
"""GPU correctness of the csrc kernels at real shapes (Llama-3.1-8B attention: 32 q / 8 KV heads, d 128).

    python3 tests/gpu/check_kernels.py [--out results.json]     (default JSON: $OUT/check_kernels.json)

Prints one row per check (name, error, bound, pass, seconds) and exits 1 if any check fails.
Tolerances: bf16 follows the flash-attention rule, max |kernel - fp32 reference| <=
2 x max |PyTorch-in-bf16 - fp32 reference| + 1e-3; fp32 uses an explicit 1e-4.
``--cpu-dry`` runs the same plumbing at toy sizes under TRITON_INTERPRET=1 (no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import bootstrap, chunked_reference, environment, make_paged, write_json

ARGS = None
RESULTS: list[dict] = []


def record(name: str, err: float, bound: float, secs: float, ok: bool | None = None, **extra) -> None:
    ok = bool(err <= bound) if ok is None else ok
    RESULTS.append({"name": name, "err": float(err), "bound": float(bound), "ok": ok, "s": round(secs, 2), **extra})
    print(f"{name:<58} {err:>10.3g} {bound:>10.3g} {'PASS' if ok else 'FAIL':>5} {secs:>7.1f}s", flush=True)
    write_json(ARGS.out, {"env": ENV, "results": RESULTS})


def run_check(name, fn):
    t = time.perf_counter()
    try:
        fn(name)
    except Exception as e:  # a crash is a failed check, and the next checks still run
        traceback.print_exc()
        RESULTS.append({"name": name, "ok": False, "error": repr(e)[:500], "s": round(time.perf_counter() - t, 2)})
        print(f"{name:<58} {'ERROR':>10} {'':>10} {'FAIL':>5}", flush=True)
        write_json(ARGS.out, {"env": ENV, "results": RESULTS})


def sz(n: int) -> int:
    """Real size on the GPU, a toy one in --cpu-dry."""
    return max(1, n // 128) + (n % 128 > 0) if ARGS.cpu_dry else n


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def tol(out_dtype, base_err: float) -> float:
    import torch

    return 1e-4 if out_dtype == torch.float32 else 2 * base_err + 1e-3


def build_batch(seqs, qls, hq, hkv, d, bs, dtype, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = DEV
    keys = [torch.randn(s, hkv, d, generator=g).to(dev, dtype) for s in seqs]
    vals = [torch.randn(s, hkv, d, generator=g).to(dev, dtype) for s in seqs]
    kc, vc, bt = make_paged(keys, vals, bs, g)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qls), 0)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dev, dtype)
    return q, kc, vc, bt, qsl.to(dev), torch.tensor(seqs, dtype=torch.int32, device=dev)


def modes_for(B, hkv, sa_share, sa_mode=1, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(B, hkv, dtype=torch.int8)
    n_sa = round(sa_share * hkv)
    for b in range(B):
        m[b, torch.randperm(hkv, generator=g)[:n_sa]] = sa_mode
    return m.to(DEV)


def poison_past_seq_len(kc, vc, bt, seqs):
    """NaN in every cache slot no request holds (past each seq_len, and unused blocks): a kernel that reads a
    key or value there, even multiplied by zero, returns NaN."""
    import torch

    bs = kc.shape[1]
    held = torch.zeros(kc.shape[0], bs, dtype=torch.bool, device=kc.device)
    for b, s in enumerate(seqs):
        pos = torch.arange(s, device=kc.device)
        held[bt[b, pos // bs].long(), pos % bs] = True
    kc[~held] = float("nan")
    vc[~held] = float("nan")


def prefill_case(seqs, qls, hq, hkv, d, bs, dtype, sink, window, sa_share, xa=None, poison=False, **kw):
    from elastic_vllm.csrc.prefill import prefill_attention

    def fn(name):
        import torch

        t = time.perf_counter()
        q, kc, vc, bt, qsl, sl = build_batch(seqs, qls, hq, hkv, d, bs, dtype)
        if poison:
            poison_past_seq_len(kc, vc, bt, seqs)
        hm = modes_for(len(seqs), hkv, sa_share)
        out = torch.full_like(q, float("nan"))
        prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=sink, window=window, out=out, **kw)
        ref = chunked_reference(q, kc, vc, bt, qsl, sl, hm, sink, window)
        base = (
            0.0
            if dtype == torch.float32
            else max_err(chunked_reference(q, kc, vc, bt, qsl, sl, hm, sink, window, compute_dtype=dtype), ref)
        )
        nan = bool(torch.isnan(out).any())
        err = float("inf") if nan else max_err(out, ref)
        record(name, err, tol(dtype, base), time.perf_counter() - t, torch_bf16_err=base)

    return fn


def prefill_vs_sdpa(S, d, bs):
    """Ours and SDPA flash (both bf16) against one fp32 reference on the same rows (the first and the
    last n queries: large outputs early, 32K-key averages late); flash-attention rule on SDPA's error."""

    def fn(name):
        import torch
        import torch.nn.functional as F
        from elastic_vllm.csrc.prefill import prefill_attention

        t = time.perf_counter()
        q, kc, vc, bt, qsl, sl = build_batch([S], [S], 32, 8, d, bs, HALF, seed=1)
        hm = modes_for(1, 8, 0.0)
        out = prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048)
        from elastic_vllm.reference.attention import gather_paged

        k = gather_paged(kc, bt[0], S).transpose(0, 1)[None].repeat_interleave(4, 1)
        v = gather_paged(vc, bt[0], S).transpose(0, 1)[None].repeat_interleave(4, 1)
        want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)[0].transpose(0, 1)
        n = min(1024, S)
        qn = torch.tensor([0, n], device=DEV, dtype=torch.int32)
        first = chunked_reference(q[:n], kc, vc, bt, qn, torch.tensor([n], device=DEV, dtype=torch.int32), hm, 0, 1)
        last = chunked_reference(q[-n:], kc, vc, bt, qn, sl, hm, 0, 1)
        err = max(max_err(out[:n], first), max_err(out[-n:], last))
        base = max(max_err(want[:n], first), max_err(want[-n:], last))
        record(name, err, tol(HALF, base), time.perf_counter() - t, sdpa_vs_fp32=base, ours_vs_sdpa=max_err(out, want))

    return fn


def xa_case(S, q_len, hq, hkv, d, bs, stride, blk, thr):
    def fn(name):
        import torch
        from elastic_vllm.csrc.prefill import prefill_attention
        from elastic_vllm.csrc.xattn_select import lists_to_block_masks, xattn_max_blocks, xattn_select

        from elastic_vllm.reference.attention import gather_paged
        from elastic_vllm.reference.xattn import xattn_block_mask_ref

        t = time.perf_counter()
        q, kc, vc, bt, qsl, sl = build_batch([S], [q_len], hq, hkv, d, bs, HALF, seed=2)
        hm = modes_for(1, hkv, 0.5, sa_mode=2)  # FA-XA: half the heads XA
        mq, mk = xattn_max_blocks(q_len, S, blk)
        idx, cnt = xattn_select(
            q, kc, bt, qsl, sl, hm, max_q_blocks=mq, max_k_blocks=mk, stride=stride, block=blk, threshold=thr
        )
        masks = lists_to_block_masks(idx, cnt, [S], [q_len], blk)
        g = hq // hkv
        rows = same = 0
        lo = (S - q_len) // blk
        k = gather_paged(kc, bt[0], S)
        for h in range(hkv):
            if int(hm[0, h]) != 2:
                continue
            want = xattn_block_mask_ref(q[:, h * g : (h + 1) * g], k[:, h], S - q_len, stride, blk, thr).cpu()
            got = masks[0][h]
            for a in range(lo, (S - 1) // blk + 1):
                rows += 1
                same += bool(torch.equal(got[a], want[a]))
        # near-threshold rows may differ (summation order); require >= 98% identical rows
        record(name + " selection rows", 1 - same / max(rows, 1), 0.02, time.perf_counter() - t, rows=rows)
        out = torch.full_like(q, float("nan"))
        prefill_attention(
            q,
            kc,
            vc,
            bt,
            qsl,
            sl,
            hm,
            sink=128,
            window=2048,
            out=out,
            xa_block_idx=idx,
            xa_block_cnt=cnt,
            xattn_block=blk,
        )
        dm = [m.to(DEV) for m in masks]
        ref = chunked_reference(q, kc, vc, bt, qsl, sl, hm, 128, 2048, dm, blk)
        base = max_err(chunked_reference(q, kc, vc, bt, qsl, sl, hm, 128, 2048, dm, blk, compute_dtype=q.dtype), ref)
        err = float("inf") if bool(torch.isnan(out).any()) else max_err(out, ref)
        record(name + " attention", err, tol(q.dtype, base), time.perf_counter() - t)

    return fn


def decode_case(seqs, hq, hkv, d, bs, dtype, sink, window, sa_share, graph=False, **kw):
    def fn(name):
        import torch
        from elastic_vllm.csrc.decode import decode_attention

        from elastic_vllm.reference.attention import hybrid_attention_ref

        t = time.perf_counter()
        q, kc, vc, bt, qsl, sl = build_batch(seqs, [1] * len(seqs), hq, hkv, d, bs, dtype, seed=3)
        hm = modes_for(len(seqs), hkv, sa_share)
        mx = max(seqs)
        if graph:
            # capture at full lengths, then shrink seq_lens in place and replay (what vLLM's graphs do)
            out = torch.empty_like(q)
            decode_attention(q, kc, vc, bt, sl, hm, sink=sink, window=window, max_seq_len=mx, out=out, **kw)
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                decode_attention(q, kc, vc, bt, sl, hm, sink=sink, window=window, max_seq_len=mx, out=out, **kw)
            sl.copy_((sl * 2) // 3)
            out.fill_(float("nan"))
            cg.replay()
            torch.cuda.synchronize()
        else:
            out = torch.full_like(q, float("nan"))
            decode_attention(q, kc, vc, bt, sl, hm, sink=sink, window=window, max_seq_len=mx, out=out, **kw)
        ref = hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, sink, window)
        base = 0.0
        if dtype != torch.float32:
            base = max_err(hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, sink, window, compute_dtype=dtype), ref)
        err = float("inf") if bool(torch.isnan(out).any()) else max_err(out, ref)
        record(name, err, tol(dtype, base), time.perf_counter() - t)

    return fn


def hf_triton_case(B, K, Q, hq, hkv, d, dtype, sink, window, sa_share):
    """The transformers engine's Triton path (``elastic_vllm.hf.triton_backend``: the whole batch as 1-token
    cache blocks, one launch) against its torch path, on a left-padded batch as generate() builds it: a
    prompt (Q == K) or a decode step (Q == 1). Padding keys are NaN for the Triton path; the reference is the
    torch path in fp32, the bound twice the torch path's own error in ``dtype``."""

    def run(name):
        import types

        import torch

        from elastic_vllm.hf import ops
        from elastic_vllm.hf.attention import _compute

        t0 = time.perf_counter()
        g = torch.Generator(device=DEV).manual_seed(11)
        cfg = types.SimpleNamespace(mode="FA-SSA", sink=sink, window=window, xattn_block=128, uses_xattn=False)
        q = torch.randn(B, hq, Q, d, device=DEV, dtype=dtype, generator=g)
        k = torch.randn(B, hkv, K, d, device=DEV, dtype=dtype, generator=g)
        v = torch.randn(B, hkv, K, d, device=DEV, dtype=dtype, generator=g)
        mask = torch.ones(B, K, dtype=torch.long, device=DEV)
        for b in range(1, B):
            mask[b, : (K // 3) * b // (B - 1)] = 0  # left padding, up to a third of the row
        modes = modes_for(B, hkv, sa_share).long().to(DEV)
        k_pos, k_valid = ops.token_positions(mask, B, K, DEV)
        ctx = [k_pos, k_valid, k_pos[:, K - Q :], k_valid[:, K - Q :], True]
        scale = d**-0.5
        ref = _compute(modes, q.float(), k.float(), v.float(), (*ctx, "torch"), cfg, scale, {})
        base = _compute(modes, q, k, v, (*ctx, "torch"), cfg, scale, {})
        kp = k.masked_fill(~k_valid[:, None, :, None], float("nan"))
        vp = v.masked_fill(~k_valid[:, None, :, None], float("nan"))
        got = _compute(modes, q, kp, vp, (*ctx, "triton"), cfg, scale, {})
        real = ctx[3][:, None, :, None].expand_as(got)
        err = max_err(got[real], ref[real])
        record(name, err, tol(dtype, max_err(base[real], ref[real])), time.perf_counter() - t0,
               ok=bool(err <= tol(dtype, max_err(base[real], ref[real])) and torch.all(got[~real] == 0)))  # fmt: skip

    return run


def route_case(lens, layers, pooling="boundary", pool_tokens=100):
    def fn(name):
        import torch
        from elastic_vllm.csrc.route import pack_router_weights, route

        from elastic_vllm.reference.rope import RopeSpec
        from elastic_vllm.reference.route import route_logits_ref
        from elastic_vllm.router.model import ElasticRouter

        t = time.perf_counter()
        hkv, d = 8, 128
        g = torch.Generator().manual_seed(4)
        kc, _vc, bt = make_paged(
            [torch.randn(n, hkv, d, generator=g).to(DEV, HALF) for n in lens],
            [torch.zeros(1, hkv, d, device=DEV, dtype=HALF) for _ in lens],
            16,
            g,
        )
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
        spec = RopeSpec(inv.to(DEV), 1.0, d, d)
        torch.manual_seed(0)
        router = ElasticRouter(layers, d).to(DEV)
        rows = torch.arange(len(lens), dtype=torch.int32, device=DEV)
        plens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        slots = torch.tensor(list(range(len(lens)))[::-1], dtype=torch.int32, device=DEV) + 1
        for layer in range(layers):  # centre the decision bias so decisions mix FA and SA
            z = route_logits_ref(kc, bt, rows, plens, router, layer, spec, pooling, pool_tokens)
            router.layers[layer].cls_router_head_agnostic[4].bias.data[1] -= (z[..., 1] - z[..., 0]).median()
        w = pack_router_weights(router)
        table = torch.full((len(lens) + 2, layers, hkv), 9, dtype=torch.int8, device=DEV)
        worst = 0.0
        wrong = 0
        for layer in range(layers):
            lg = torch.full((len(lens), hkv, 2), float("nan"), device=DEV)
            route(kc, bt, rows, plens, slots, w, layer, table, inv_freq=spec.inv_freq, logits_out=lg,
                  pooling=pooling, pool_tokens=pool_tokens)  # fmt: skip
            want = route_logits_ref(kc, bt, rows, plens, router, layer, spec, pooling, pool_tokens)
            worst = max(worst, max_err(lg, want))
            margin = want[..., 1] - want[..., 0]
            sure = margin.abs() > 1e-4
            dec = torch.where(margin > 0, 0, 1).to(torch.int8)
            wrong += int((table[slots.long(), layer] != dec)[sure].sum())
        record(name, worst, 1e-4, time.perf_counter() - t, ok=worst <= 1e-4 and wrong == 0, wrong_decisions=wrong)

    return fn


def main() -> int:
    global ARGS, ENV, DEV, HALF
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default=os.path.join(os.environ["OUT"], "check_kernels.json") if os.environ.get("OUT") else None
    )
    ap.add_argument("--cpu-dry", action="store_true", help="toy sizes under TRITON_INTERPRET=1 (plumbing check)")
    ap.add_argument("-k", default="", help="run only checks whose name contains this")
    ARGS = ap.parse_args()
    if ARGS.cpu_dry:
        os.environ["TRITON_INTERPRET"] = "1"
    bootstrap()
    import torch

    if not ARGS.cpu_dry and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry for a plumbing check)")
        return 2
    DEV = torch.device("cpu" if ARGS.cpu_dry else "cuda")
    ENV = environment()
    print(ENV)
    print(f"{'check':<58} {'err':>10} {'bound':>10} {'':>5} {'time':>8}")
    bf, f32 = torch.bfloat16, torch.float32
    if ARGS.cpu_dry:
        bf = torch.float16  # the interpreter mishandles bf16
    HALF = bf
    S8, S32, S128 = sz(8192), sz(32768), sz(131072)
    W = sz(2048)
    checks = [
        ("prefill 8K bf16 d128 GQA4 50% SSA bs16", prefill_case([S8], [S8], 32, 8, 128, 16, bf, 128, W, 0.5)),
        (
            "prefill varlen+chunked bf16 d128 mixed bs16",
            prefill_case([3000, 1023, 5000, 17, 1], [3000, 1023, 1200, 1, 1], 32, 8, 128, 16, bf, 128, 512, 0.5)
            if not ARGS.cpu_dry
            else prefill_case([30, 63, 50, 17, 1], [30, 63, 12, 1, 1], 8, 2, 32, 16, bf, 4, 9, 0.5),
        ),
        (
            "prefill varlen+chunked fp32 d128 mixed bs16",
            prefill_case([3000, 1023, 1200], [3000, 511, 1], 32, 8, 128, 16, f32, 128, 512, 0.5)
            if not ARGS.cpu_dry
            else prefill_case([30, 63], [30, 13], 8, 2, 32, 16, f32, 4, 9, 0.5),
        ),
        (
            "prefill 4K bf16 d64 GQA8 75% SSA bs16",
            prefill_case([sz(4096)], [sz(4096)], 16, 2, 64, 16, bf, 64, sz(1024), 0.75),
        ),
        (
            "prefill varlen bf16 d128 bs128 (tile in block)",
            prefill_case([sz(4096), sz(2500)], [sz(4096), sz(700)], 32, 8, 128, 128, bf, 128, sz(1024), 0.5),
        ),
        (
            "prefill varlen+chunked bf16 d128 mixed bs128, NaN past seq_len",
            prefill_case(
                [3000, 1023, 5000, 17, 1], [3000, 1023, 1200, 1, 1], 32, 8, 128, 128, bf, 128, 512, 0.5, poison=True
            )
            if not ARGS.cpu_dry
            else prefill_case(
                [30, 63, 50, 17, 1],
                [30, 63, 12, 1, 1],
                8,
                2,
                32,
                32,
                bf,
                4,
                9,
                0.5,
                poison=True,
                block_m=16,
                block_n=16,
            ),
        ),
        (
            "prefill 32K bf16 d128 75% SSA (sink128 w2048) bs16",
            prefill_case([S32], [S32], 32, 8, 128, 16, bf, 128, W, 0.75),
        ),
        ("prefill 32K dense vs SDPA flash", prefill_vs_sdpa(S32, 128, 16)),
        (
            "prefill varlen+chunked bf16 d128 bs128",
            prefill_case([S8, sz(3000), sz(700)], [S8, sz(1000), sz(700)], 32, 8, 128, 128, bf, 128, W, 0.75),
        ),
        (
            "prefill 8K bf16 d128 bs64 block_n 64",
            prefill_case([S8], [S8], 32, 8, 128, 64, bf, 128, W, 0.5, block_n=64),
        ),
        (
            "prefill 8K bf16 d64 GQA4 bs128 default config",
            prefill_case([S8], [S8], 32, 8, 64, 128, bf, 128, W, 0.5),
        ),
        (
            "hf triton path: padded prompt B3 4K bf16 50% SSA",
            hf_triton_case(3, sz(4096), sz(4096), 32, 8, 128, bf, 4 if ARGS.cpu_dry else 128, sz(1024), 0.5),
        ),
        (
            "hf triton path: padded decode step B3 4K bf16 50% SSA",
            hf_triton_case(3, sz(4096), 1, 32, 8, 128, bf, 4 if ARGS.cpu_dry else 128, sz(1024), 0.5),
        ),
        (
            "xattn 8K FA-XA tau0.9",
            xa_case(S8, S8, 32, 8, 128, 16, 16 if not ARGS.cpu_dry else 4, 128 if not ARGS.cpu_dry else 16, 0.9),
        ),
        (
            "xattn 8K chunk of 3000 mid-block",
            xa_case(
                S8, sz(3000) + 3, 32, 8, 128, 16, 16 if not ARGS.cpu_dry else 4, 128 if not ARGS.cpu_dry else 16, 0.9
            ),
        ),
        (
            "decode B16 ragged to 32K bf16 50% SSA",
            decode_case(
                [sz(n) for n in (1, 63, 113, 1023, 4096, 8191, 32768, 20000) * 2], 32, 8, 128, 16, bf, 128, W, 0.5
            ),
        ),
        (
            "decode B4 128K bf16 dense",
            decode_case([S128, S128 - 5, sz(70000), sz(1000)], 32, 8, 128, 16, bf, 128, W, 0.0),
        ),
        (
            "decode B4 128K bf16 75% SSA",
            decode_case([S128, S128 - 5, sz(70000), sz(1000)], 32, 8, 128, 16, bf, 128, W, 0.75),
        ),
        (
            "decode B8 fp32 d64 GQA4 bs64",
            decode_case([sz(n) for n in (5000, 100, 17, 9000) * 2], 16, 4, 64, 64, f32, 64, sz(512), 0.5),
        ),
        (
            "decode CUDA graph replay (seq_lens shrunk in place)",
            decode_case([sz(n) for n in (40000, 30000, 2000, 512)], 32, 8, 128, 16, bf, 128, W, 0.5, graph=True)
            if not ARGS.cpu_dry
            else None,
        ),
        (
            "route 4 layers, prompts 8K/150/128K (boundary 100)",
            route_case([sz(8192), 150, S128], 4) if not ARGS.cpu_dry else route_case([300, 150, 20], 2),
        ),
        (
            "route 2 layers, whole pooling, prompts 8K/150/20K",
            route_case([sz(8192), 150, sz(20000)], 2, "whole")
            if not ARGS.cpu_dry
            else route_case([300, 150, 20], 2, "whole"),
        ),
        (
            "route 2 layers, boundary 400 (pooling launch), 128K/900",
            route_case([S128, 900], 2, "boundary", 400)
            if not ARGS.cpu_dry
            else route_case([300, 90], 2, "boundary", 300),
        ),
    ]
    for name, fn in checks:
        if fn is not None and ARGS.k in name:
            run_check(name, fn)
    n_bad = sum(not r["ok"] for r in RESULTS)
    print(f"{len(RESULTS) - n_bad} passed, {n_bad} failed")
    write_json(ARGS.out, {"env": ENV, "results": RESULTS})
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
