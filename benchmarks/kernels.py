#!/usr/bin/env python3
"""Kernel benchmarks: correctness first, then timing against the anchors, in one run on one GPU.

    python3 benchmarks/kernels.py [--out PATH] [--quick] [--budget SECONDS]

Prefill (Llama-3.1-8B attention: 32 q / 8 KV heads, bf16, batch 1, causal; head_dim 128 and 64;
SSA heads with sink 128 + window 2048; SA share = share of KV heads in SSA), at 8K/32K/128K/256K:
  ours    elastic_vllm.csrc.prefill over a paged cache (block 16, randomly permuted blocks)
  sdpa    torch SDPA flash backend, dense causal (GQA through enable_gqa)
  flex    FlexAttention, ONE call, per-head BlockMask (exact full/partial blocks) = the hybrid anchor
  split   SDPA flash on the FA heads + Flex on the SA heads, two calls (heads pre-split, untimed)
Decode at 32K/128K contexts, batch 1/16/64, dense (every head FA) vs sparse (75% SSA).
Router: all 32 layers of an 8B-shaped model (8 KV heads, d 128) for one request (eager and graph).
Reports median ms with p20/p80 (triton.testing.do_bench), TFLOP/s or TB/s counting only the work
the mask requires, ratios to each anchor; JSON (GPU, torch/triton versions, git commit) written
after every measurement, so a run cut short keeps what it measured. Sections run in priority
order and are skipped (and listed as skipped) once --budget seconds are used.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import torch  # noqa: E402  (does not import triton: TRITON_INTERPRET can still be set in main)
from _gpu_common import (  # noqa: E402
    bench,
    bootstrap,
    chunked_reference,
    decode_visible_tokens,
    env_info,
    make_paged,
    ssa_visible_pairs,
    write_json,
)

HQ, HKV, SINK, WINDOW, BS = 32, 8, 128, 2048, 16
T0 = time.perf_counter()
REPORT: dict = {}
ARGS = None
DEV = torch.device("cpu")
DT = torch.bfloat16


def elapsed() -> float:
    return time.perf_counter() - T0


def save() -> None:
    REPORT["elapsed_s"] = round(elapsed(), 1)
    write_json(ARGS.out, REPORT)


def log(msg: str) -> None:
    print(f"[{elapsed():6.0f}s] {msg}", flush=True)


def section(name: str, fn, est_s: float) -> None:
    """Run fn unless the time budget would be exceeded; failures are recorded, not fatal."""
    if ARGS.sections and not any(k in name for k in ARGS.sections.split(",")):
        return
    if elapsed() + est_s > ARGS.budget:
        REPORT.setdefault("skipped", []).append({"section": name, "reason": f"time budget ({ARGS.budget}s)"})
        log(f"SKIP {name} (budget)")
        save()
        return
    log(f"== {name}")
    try:
        fn()
    except Exception as e:
        traceback.print_exc()
        REPORT.setdefault("errors", []).append({"section": name, "error": repr(e)[:1000]})
    finally:
        gc.collect()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        save()


def timeit(fn, **kw) -> dict:
    if DEV.type != "cuda":  # --cpu-dry: one timed call, plumbing only
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return {"ms": ms, "p20": ms, "p80": ms}
    return bench(fn, **kw)


# ------------------------------------------------------------------------------------------ inputs
def prefill_inputs(S: int, d: int, seed: int = 0) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(S, HQ, d, device=DEV, dtype=DT, generator=g)
    k = torch.randn(S, HKV, d, device=DEV, dtype=DT, generator=g)
    v = torch.randn(S, HKV, d, device=DEV, dtype=DT, generator=g)
    kc, vc, bt = make_paged([k], [v], BS, torch.Generator().manual_seed(seed))
    return {
        "q": q,
        "kc": kc,
        "vc": vc,
        "bt": bt,
        "qsl": torch.tensor([0, S], device=DEV, dtype=torch.int32),
        "sl": torch.tensor([S], device=DEV, dtype=torch.int32),
        "qT": q.transpose(0, 1).contiguous()[None],  # [1, Hq, S, d] for SDPA / Flex
        "kT": k.transpose(0, 1).contiguous()[None],
        "vT": v.transpose(0, 1).contiguous()[None],
    }


def sa_heads(share: float) -> list[bool]:
    n = round(share * HKV)
    return [h < n for h in range(HKV)]


def head_modes(share: float) -> torch.Tensor:
    return torch.tensor([[1 if s else 0 for s in sa_heads(share)]], device=DEV, dtype=torch.int8)


def prefill_flops(S: int, d: int, share: float) -> float:
    n_sa = sum(sa_heads(share)) * (HQ // HKV)
    pairs = (HQ - n_sa) * S * (S + 1) // 2 + n_sa * ssa_visible_pairs(S, SINK, WINDOW)
    return 4.0 * d * pairs


# ------------------------------------------------------------------------------------------ anchors
def sdpa_fn(x: dict):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qT, kT, vT = x["qT"], x["kT"], x["vT"]
    backends = [SDPBackend.FLASH_ATTENTION] if DEV.type == "cuda" else [SDPBackend.MATH]

    def gqa():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(qT, kT, vT, is_causal=True, enable_gqa=True)

    try:
        gqa()
        return gqa, "flash+enable_gqa"
    except RuntimeError:  # flash without GQA support: expand K/V outside the timed call
        kE, vE = kT.repeat_interleave(HQ // HKV, 1), vT.repeat_interleave(HQ // HKV, 1)

        def expanded():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qT, kE, vE, is_causal=True)

        return expanded, "flash, K/V expanded"


def flex_block_mask(S: int, is_sa_q: list[bool]):
    """BlockMask with exact full/partial blocks (what create_block_mask would build), built block-wise."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    blk = 128
    sa_t = torch.tensor(is_sa_q, device=DEV)

    def mask_mod(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        ssa = (kv_idx < SINK) | (q_idx - kv_idx < WINDOW)
        return causal & (ssa | ~sa_t[h])

    nb = S // blk
    if S % blk:
        return create_block_mask(mask_mod, 1, len(is_sa_q), S, S, device=DEV), mask_mod
    a = torch.arange(nb, device=DEV)
    a0, a1 = (a * blk)[:, None], (a * blk + blk - 1)[:, None]
    c0, c1 = (a * blk)[None, :], (a * blk + blk - 1)[None, :]
    fa_full, fa_part = c1 <= a0, (c0 <= a1) & (c1 > a0)
    any_vis = (c0 <= a1) & ((c0 < SINK) | ((a0 - c1).clamp(min=0) < WINDOW))
    all_vis = (c1 <= a0) & ((c1 < SINK) | (a1 - torch.clamp(c0, min=SINK) < WINDOW))
    ssa_full, ssa_part = all_vis, any_vis & ~all_vis

    def lists(m):  # [H, nb, nb] bool -> counts [1, H, nb], indices [1, H, nb, nb] (selected first)
        return m.sum(-1).to(torch.int32)[None], torch.argsort(
            m.to(torch.int8), dim=-1, descending=True, stable=True
        ).to(torch.int32)[None]

    sel = torch.tensor(is_sa_q, device=DEV)[:, None, None]
    part = torch.where(sel, ssa_part[None], fa_part[None])
    full = torch.where(sel, ssa_full[None], fa_full[None])
    kn, ki = lists(part)
    fn, fi = lists(full)
    try:
        bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=blk, mask_mod=mask_mod, compute_q_blocks=False)
    except TypeError:
        bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=blk, mask_mod=mask_mod)
    return bm, mask_mod


_FLEX = {}


def flex_compiled(kind: str):
    """One compiled flex per use: the one-call hybrid static (as measured in ANCHORS.md); the split's
    SA-only call dynamic, so its varying head count does not recompile per share."""
    from torch.nn.attention.flex_attention import flex_attention

    if DEV.type != "cuda":
        return flex_attention
    if kind not in _FLEX:
        _FLEX[kind] = torch.compile(flex_attention, dynamic=(kind == "split"))
    return _FLEX[kind]


def flex_hybrid_fn(x: dict, share: float):
    is_sa_q = [s for s in sa_heads(share) for _ in range(HQ // HKV)]
    bm, _ = flex_block_mask(x["qT"].shape[2], is_sa_q)
    flex = flex_compiled("hybrid")
    return lambda: flex(x["qT"], x["kT"], x["vT"], block_mask=bm, enable_gqa=True)


def split_fn(x: dict, share: float, sdpa_full):
    """FA heads through SDPA flash, SA heads through Flex: two calls on pre-split head groups."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sa = sa_heads(share)
    g = HQ // HKV
    fa_kv = [h for h in range(HKV) if not sa[h]]
    sa_kv = [h for h in range(HKV) if sa[h]]
    calls = []
    if fa_kv and sa_kv:
        qi = torch.tensor([h * g + j for h in fa_kv for j in range(g)], device=DEV)
        q1, k1, v1 = (x["qT"][:, qi].contiguous(), x["kT"][:, fa_kv].contiguous(), x["vT"][:, fa_kv].contiguous())
        be = [SDPBackend.FLASH_ATTENTION] if DEV.type == "cuda" else [SDPBackend.MATH]

        def fa_call():
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True)

        calls.append(fa_call)
    elif fa_kv:
        calls.append(sdpa_full)
    if sa_kv:
        qi = torch.tensor([h * g + j for h in sa_kv for j in range(g)], device=DEV)
        q2, k2, v2 = (x["qT"][:, qi].contiguous(), x["kT"][:, sa_kv].contiguous(), x["vT"][:, sa_kv].contiguous())
        bm, _ = flex_block_mask(q2.shape[2], [True] * q2.shape[1])
        flex = flex_compiled("split")
        calls.append(lambda: flex(q2, k2, v2, block_mask=bm, enable_gqa=True))
    return lambda: [c() for c in calls]


def ours_fn(x: dict, share: float, **cfg):
    from elastic_vllm.csrc.prefill import prefill_attention

    hm = head_modes(share)
    out = torch.empty_like(x["q"])
    return lambda: prefill_attention(
        x["q"], x["kc"], x["vc"], x["bt"], x["qsl"], x["sl"], hm, sink=SINK, window=WINDOW, out=out, **cfg
    )


# ------------------------------------------------------------------------------------------ sections
def ceilings() -> None:
    n = (1 << 30) if DEV.type == "cuda" else (1 << 20)
    src = torch.empty(n, device=DEV, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src))
    mm = 8192 if DEV.type == "cuda" else 256
    a = torch.randn(mm, mm, device=DEV, dtype=DT)
    b = torch.randn(mm, mm, device=DEV, dtype=DT)
    tm = timeit(lambda: a @ b)
    REPORT["ceilings"] = {
        "copy_TBps": 2 * 4 * n / (t["ms"] * 1e-3) / 1e12,
        "bf16_matmul_TFLOPs": 2 * mm**3 / (tm["ms"] * 1e-3) / 1e12,
    }
    log(f"ceilings {REPORT['ceilings']}")


def correctness() -> None:
    from elastic_vllm.csrc.decode import decode_attention

    from elastic_vllm.reference.attention import hybrid_attention_ref

    res = REPORT.setdefault("correctness", [])
    S = 8192 if DEV.type == "cuda" else 256
    for d in (128, 64) if not ARGS.quick else (128,):
        x = prefill_inputs(S, d, seed=1)
        for share in (0.0, 0.75):
            hm = head_modes(share)
            from elastic_vllm.csrc.prefill import prefill_attention

            out = prefill_attention(x["q"], x["kc"], x["vc"], x["bt"], x["qsl"], x["sl"], hm, sink=SINK, window=WINDOW)
            ref = chunked_reference(x["q"], x["kc"], x["vc"], x["bt"], x["qsl"], x["sl"], hm, SINK, WINDOW)
            base = chunked_reference(
                x["q"], x["kc"], x["vc"], x["bt"], x["qsl"], x["sl"], hm, SINK, WINDOW, compute_dtype=DT
            )
            err = float((out.float() - ref.float()).abs().max())
            bound = 2 * float((base.float() - ref.float()).abs().max()) + 1e-3
            item = {"what": f"prefill {S} d{d} SA {share}", "err": err, "bound": bound, "ok": err <= bound}
            fo = flex_hybrid_fn(x, share)()[0].transpose(0, 1)
            item["flex_err"] = float((fo.float() - ref.float()).abs().max())
            res.append(item)
            log(item)
        del x
    # decode, 16 requests of ragged length, sparse
    B = 16
    g = torch.Generator().manual_seed(2)
    lens = [int(n) for n in torch.randint(1, S, (B,), generator=g)]
    keys = [torch.randn(n, HKV, 128, generator=g).to(DEV, DT) for n in lens]
    vals = [torch.randn(n, HKV, 128, generator=g).to(DEV, DT) for n in lens]
    kc, vc, bt = make_paged(keys, vals, BS, g)
    q = torch.randn(B, HQ, 128, generator=g).to(DEV, DT)
    sl = torch.tensor(lens, device=DEV, dtype=torch.int32)
    qsl = torch.arange(B + 1, device=DEV, dtype=torch.int32)
    hm = torch.tensor([[1 if h % 4 else 0 for h in range(HKV)]] * B, device=DEV, dtype=torch.int8)
    out = decode_attention(q, kc, vc, bt, sl, hm, sink=SINK, window=WINDOW, max_seq_len=S)
    ref = hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, SINK, WINDOW)
    base = hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, SINK, WINDOW, compute_dtype=DT)
    err = float((out.float() - ref).abs().max())
    bound = 2 * float((base.float() - ref).abs().max()) + 1e-3
    res.append({"what": "decode B16 ragged sparse", "err": err, "bound": bound, "ok": err <= bound})
    log(res[-1])
    save()


def prefill_section(S: int, d: int, shares) -> None:
    x = prefill_inputs(S, d)
    rows = REPORT.setdefault("prefill", [])
    sdpa, how = sdpa_fn(x)
    t_sdpa = timeit(sdpa)
    dense_flops = prefill_flops(S, d, 0.0)
    rows.append({"S": S, "d": d, "method": "sdpa_flash_dense", "how": how, **t_sdpa,
                 "TFLOPs": dense_flops / (t_sdpa["ms"] * 1e-3) / 1e12})  # fmt: skip
    log(rows[-1])
    save()
    for share in shares:
        flops = prefill_flops(S, d, share)
        res = {}
        fns = {"ours": ours_fn(x, share), "flex_hybrid": flex_hybrid_fn(x, share)}
        if 0.0 < share < 1.0:
            fns["split"] = split_fn(x, share, sdpa)
        for name, fn in fns.items():
            try:
                res[name] = timeit(fn)
            except Exception as e:
                traceback.print_exc()
                res[name] = {"error": repr(e)[:300]}
        ours = res["ours"].get("ms")
        for name, r in res.items():
            row = {"S": S, "d": d, "share": share, "method": name, **r}
            if "ms" in r:
                row["TFLOPs"] = flops / (r["ms"] * 1e-3) / 1e12
                if name == "ours":
                    row["x_vs_sdpa"] = t_sdpa["ms"] / r["ms"]
                    for other in ("flex_hybrid", "split"):
                        if "ms" in res.get(other, {}):
                            row[f"x_vs_{other}"] = res[other]["ms"] / r["ms"]
                elif ours:
                    row["ours_speedup"] = r["ms"] / ours
            rows.append(row)
            log(row)
        save()
    del x


def decode_section(ctx: int, batches) -> None:
    for B in batches:
        decode_batch(ctx, B)
        save()


def decode_batch(ctx: int, B: int) -> None:
    from elastic_vllm.csrc.decode import decode_attention

    rows = REPORT.setdefault("decode", [])
    d = 128
    nblk = B * math.ceil(ctx / BS)
    kv = torch.randn(nblk + 1, 2, BS, HKV, d, device=DEV, dtype=DT)
    bt = (torch.randperm(nblk, device=DEV) + 1).to(torch.int32).view(B, -1)
    q = torch.randn(B, HQ, d, device=DEV, dtype=DT)
    sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    out = torch.empty_like(q)
    res = {}
    for mode, share in (("dense", 0.0), ("sparse", 0.75)):
        hm = head_modes(share).expand(B, HKV).contiguous()
        n_sa = sum(sa_heads(share))
        toks = (HKV - n_sa) * ctx + n_sa * decode_visible_tokens(ctx, SINK, WINDOW)
        nbytes = B * toks * d * 2 * kv.element_size()
        fn = functools.partial(
            decode_attention, q, kv[:, 0], kv[:, 1], bt, sl, hm, sink=SINK, window=WINDOW, max_seq_len=ctx, out=out
        )
        r = timeit(fn)
        res[mode] = r
        row = {"ctx": ctx, "B": B, "mode": mode, **r, "TBps": nbytes / (r["ms"] * 1e-3) / 1e12}
        if mode == "sparse":
            row["x_vs_dense"] = res["dense"]["ms"] / r["ms"]
        if "ceilings" in REPORT:
            row["frac_of_copy_bw"] = row["TBps"] / REPORT["ceilings"]["copy_TBps"]
        rows.append(row)
        log(row)


def route_all_layers(router, kc, bts, one, plen) -> None:
    for layer, bt in enumerate(bts):
        router(kc, bt, one, plen, one, layer)


def router_section() -> None:
    from elastic_vllm.csrc.route import Router, pack_router_weights, route_errors

    from elastic_vllm.router.model import ElasticRouter

    L, d = 32, 128
    torch.manual_seed(0)
    w = pack_router_weights(ElasticRouter(L, d)).to(DEV)
    inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    rows = REPORT.setdefault("router", [])
    for S in (8192, 131072) if DEV.type == "cuda" else (512,):
        nblk = math.ceil(S / BS)
        # one cache per layer would be 32 x S tokens; layers share one cache through different block tables
        kc = torch.randn(nblk + 1, BS, HKV, d, device=DEV, dtype=DT)
        bts = [(torch.randperm(nblk, device=DEV) + 1).to(torch.int32)[None] for _ in range(L)]
        one = torch.zeros(1, device=DEV, dtype=torch.int32)
        plen = torch.tensor([S], device=DEV, dtype=torch.int32)
        table = torch.zeros(4, L, HKV, device=DEV, dtype=torch.int8)
        for fused in (True, False) if DEV.type == "cuda" else (False,):
            router = Router(w, table, inv_freq=inv, num_kv_heads=HKV, head_dim=d, block_size=BS, fused=fused)
            all_layers = functools.partial(route_all_layers, router, kc, bts, one, plen)
            r = timeit(all_layers)
            row = {"prompt": S, "layers": L, "fused": fused, "eager": r}
            if DEV.type == "cuda":
                all_layers()
                torch.cuda.synchronize()
                cg = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cg):
                    all_layers()
                row["graph"] = timeit(cg.replay)
                row["barrier_timeouts"] = route_errors(DEV)
            rows.append(row)
            log(row)
            save()


def sweep_section() -> None:
    """A few prefill tile configs and block sizes at 32K, and decode splits/tiles at 128K: tuning data."""
    from elastic_vllm.csrc.decode import decode_attention

    rows = REPORT.setdefault("sweep", [])
    S = 32768 if DEV.type == "cuda" else 256
    x = prefill_inputs(S, 128)
    configs = [
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4},
        {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "pipeline_qk": True},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "pipeline_qk": True},
    ]
    for cfg in configs:
        for share in (0.0, 0.75):
            if elapsed() > ARGS.budget - 30:
                return
            try:
                r = timeit(ours_fn(x, share, **cfg))
            except Exception as e:  # e.g. out of registers/shared memory for this config
                r = {"error": repr(e)[:300]}
            if "ms" in r:
                r["TFLOPs"] = prefill_flops(S, 128, share) / (r["ms"] * 1e-3) / 1e12
            rows.append({"kernel": "prefill", "S": S, "share": share, "bs": BS, **cfg, **r})
            log(rows[-1])
            save()
    # the same data in 128-token blocks: every key tile inside one physical block
    k = torch.stack([x["kc"], x["vc"]], 1)
    from elastic_vllm.reference.attention import gather_paged

    keys, vals = gather_paged(k[:, 0], x["bt"][0], S), gather_paged(k[:, 1], x["bt"][0], S)
    kc, vc, bt = make_paged([keys], [vals], 128, torch.Generator().manual_seed(3))
    x128 = dict(x, kc=kc, vc=vc, bt=bt)
    for share in (0.0, 0.75):
        r = timeit(ours_fn(x128, share))
        rows.append({"kernel": "prefill", "S": S, "share": share, "bs": 128, **r,
                     "TFLOPs": prefill_flops(S, 128, share) / (r["ms"] * 1e-3) / 1e12})  # fmt: skip
        log(rows[-1])
    del x, x128, k
    save()
    ctx, B = (131072, 16) if DEV.type == "cuda" else (1024, 2)
    nblk = B * math.ceil(ctx / BS)
    kv = torch.randn(nblk + 1, 2, BS, HKV, 128, device=DEV, dtype=DT)
    bt = (torch.randperm(nblk, device=DEV) + 1).to(torch.int32).view(B, -1)
    q = torch.randn(B, HQ, 128, device=DEV, dtype=DT)
    sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    for share in (0.0, 0.75):
        hm = head_modes(share).expand(B, HKV).contiguous()
        for cfg in ({"block_n": 64, "num_stages": 3}, {"block_n": 128, "num_stages": 3}, {"block_n": 64, "num_stages": 4},
                    {"block_n": 32, "num_stages": 4}, {"block_n": 64, "num_stages": 3, "num_splits": 32}):  # fmt: skip
            if elapsed() > ARGS.budget - 15:
                return
            r = timeit(lambda hm=hm, cfg=cfg: decode_attention(
                q, kv[:, 0], kv[:, 1], bt, sl, hm, sink=SINK, window=WINDOW, max_seq_len=ctx, **cfg))  # fmt: skip
            rows.append({"kernel": "decode", "ctx": ctx, "B": B, "share": share, **cfg, **r})
            log(rows[-1])
            save()


def main() -> int:
    global ARGS, DEV, DT, SINK, WINDOW
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<time>.json)")
    ap.add_argument("--quick", action="store_true", help="reduced grid: 8K/32K, SA 0/0.75, d 128, no sweep")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--sections", default="", help="comma-separated name filters (e.g. 'decode,router')")
    ap.add_argument("--cpu-dry", action="store_true", help="toy sizes under TRITON_INTERPRET=1 (plumbing check)")
    ARGS = ap.parse_args()
    if ARGS.cpu_dry:
        os.environ["TRITON_INTERPRET"] = "1"
    if ARGS.out is None:
        ARGS.out = str(ROOT / "benchmarks" / "results" / f"kernels-{time.strftime('%Y%m%d-%H%M%S')}.json")
    bootstrap()
    if not ARGS.cpu_dry and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry for a plumbing check)")
        return 2
    DEV = torch.device("cpu" if ARGS.cpu_dry else "cuda")
    DT = torch.float16 if ARGS.cpu_dry else torch.bfloat16
    if ARGS.cpu_dry:
        SINK, WINDOW = 16, 100  # toy sequences: keep the SSA mask non-trivial
    REPORT.update({"env": env_info(), "config": {"Hq": HQ, "Hkv": HKV, "sink": SINK, "window": WINDOW,
                   "block_size": BS, "dtype": str(DT), "quick": ARGS.quick, "budget_s": ARGS.budget}})  # fmt: skip
    log(REPORT["env"])
    save()
    dry = ARGS.cpu_dry
    seqs = [256] if dry else ([8192, 32768] if ARGS.quick else [8192, 32768, 131072])
    shares = (0.0, 0.75) if ARGS.quick else (0.0, 0.5, 0.75, 1.0)
    section("ceilings", ceilings, 5)
    section("correctness", correctness, 20)
    for S in seqs:
        section(f"prefill S={S} d=128", lambda S=S: prefill_section(S, 128, shares), 10 + 2.5e-9 * S * S)
    section("decode 32K", lambda: decode_section(32768 if not dry else 512, (1, 16, 64) if not dry else (2,)), 25)
    if not ARGS.quick and not dry:
        section("decode 128K", lambda: decode_section(131072, (1, 16, 64)), 40)
    section("router", router_section, 20)
    if not ARGS.quick:
        section("sweep", sweep_section, 90 if not dry else 1)  # tuning data first: most useful per second
        for S in [256] if dry else [8192, 32768, 131072]:
            section(f"prefill S={S} d=64", lambda S=S: prefill_section(S, 64, shares), 10 + 1.5e-9 * S * S)
        if not dry:
            section("prefill S=262144 d=128", lambda: prefill_section(262144, 128, shares), 130)
    save()
    bad = [c for c in REPORT.get("correctness", []) if not c["ok"]]
    log(f"done: {len(bad)} correctness failures, {len(REPORT.get('errors', []))} section errors -> {ARGS.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
