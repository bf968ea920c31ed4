#!/usr/bin/env python3
"""Kernel benchmarks: correctness first, then timing against the anchors, in one run on one GPU.

    GIT_COMMIT=<sha> python3 benchmarks/kernels.py [--out PATH] [--quick] [--sections NAME,...]

Prefill (Llama-3.1-8B attention: 32 q / 8 KV heads, bf16, batch 1, causal; head_dim 128 and 64;
SSA heads with sink 128 + window 2048; SA share = share of KV heads in SSA), at 8K/32K/128K/256K:
  ours    elastic_vllm.csrc.prefill over a paged cache (randomly permuted blocks) in the config the
          tune section picked at 32K (block size 16 or 128, 64/128-key tiles, warps)
  sdpa    torch SDPA flash backend, dense causal (GQA through enable_gqa)
  flex    FlexAttention, ONE compiled call, per-head BlockMask (exact full/partial blocks) = the hybrid anchor
  split   SDPA flash on the FA heads + compiled Flex on the SA heads, two calls (heads pre-split, untimed)
Decode at 32K/128K contexts, batch 1/16/64, dense (every head FA) vs sparse (75% SSA).
Router: all 32 layers of an 8B-shaped model (8 KV heads, d 128) for one request (eager and graph).
Reports median ms with p20/p80 (triton.testing.do_bench), TFLOP/s or TB/s counting only the work
the mask requires, ratios to each anchor; JSON (GPU, torch/triton versions, commit from $GIT_COMMIT)
written after every measurement, so a run cut short keeps what it measured. Every section asked for
runs (``--sections``: name filters; ``--quick``: the reduced grid); a device session too short for the
whole grid splits it over calls by section (``tools/gpu_session.sh kernels`` with SECTIONS). On an
H200 the whole grid takes ~7 min, compiles included; correctness, tune and prefill 32K ~1.5 min.
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

import torch  # (does not import triton: TRITON_INTERPRET can still be set in main)
from _harness import ROOT, bench, bootstrap, environment, gate, log, quantiles, write_json

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from _gpu_common import chunked_reference, decode_visible_tokens, make_paged, ssa_visible_pairs

HQ, HKV, SINK, WINDOW, BS = 32, 8, 128, 2048, 16
REPORT: dict = {}
ARGS = None
DEV = torch.device("cpu")
DT = torch.bfloat16


def save() -> None:
    write_json(ARGS.out, REPORT)


def section(name: str, fn) -> None:
    """Run fn if ``--sections`` selects it (all by default; on a GPU the correctness gate always, under --cpu-dry
    only when named: there the plumbing is what is checked); a failure is recorded, the next section runs."""
    is_gate = name == "correctness" and not ARGS.cpu_dry
    if ARGS.sections and not is_gate and not any(k in name for k in ARGS.sections.split(",")):
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
    return bench(fn, cuda=DEV.type == "cuda", **kw)


# ------------------------------------------------------------------------------------------ inputs
def prefill_inputs(S: int, d: int, seed: int = 0) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(S, HQ, d, device=DEV, dtype=DT, generator=g)
    k = torch.randn(S, HKV, d, device=DEV, dtype=DT, generator=g)
    v = torch.randn(S, HKV, d, device=DEV, dtype=DT, generator=g)
    x = {
        "q": q,
        "qsl": torch.tensor([0, S], device=DEV, dtype=torch.int32),
        "sl": torch.tensor([S], device=DEV, dtype=torch.int32),
        "qT": q.transpose(0, 1).contiguous()[None],  # [1, Hq, S, d] for SDPA / Flex
        "kT": k.transpose(0, 1).contiguous()[None],
        "vT": v.transpose(0, 1).contiguous()[None],
        "seed": seed,
        "caches": {},
    }
    del k, v
    return x


def paged(x: dict, bs: int) -> tuple:
    """(key_cache, value_cache, block_table) of x's keys in ``bs``-token blocks (views of one
    [num_blocks, 2, bs, Hkv, d] tensor, randomly permuted blocks), built once per block size."""
    if bs not in x["caches"]:
        k, v = x["kT"][0].transpose(0, 1), x["vT"][0].transpose(0, 1)
        x["caches"][bs] = make_paged([k], [v], bs, torch.Generator().manual_seed(x["seed"] + bs))
    return x["caches"][bs]


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


SA_FLAGS = None  # [Hq] bool tensor read by the hybrid mask_mod, updated in place per share
_BLOCK_MASKS: dict = {}
_FLEX: dict = {}


def _hybrid_mask_mod(b, h, q_idx, kv_idx):
    causal = q_idx >= kv_idx
    ssa = (kv_idx < SINK) | (q_idx - kv_idx < WINDOW)
    return causal & (ssa | ~SA_FLAGS[h])


def _ssa_mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((kv_idx < SINK) | (q_idx - kv_idx < WINDOW))


def set_sa_flags(is_sa_q: list[bool]) -> None:
    """The hybrid mask_mod reads these flags at call time; the BlockMask of the same share matches."""
    global SA_FLAGS
    t = torch.tensor(is_sa_q, device=DEV)
    if SA_FLAGS is None or SA_FLAGS.shape != t.shape:
        SA_FLAGS = t
    else:
        SA_FLAGS.copy_(t)


def flex_block_mask(S: int, is_sa_q: list[bool], mask_mod):
    """BlockMask with exact full/partial blocks (what create_block_mask would build), built block-wise, cached."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    key = (S, tuple(is_sa_q), mask_mod.__name__)
    if key in _BLOCK_MASKS:
        return _BLOCK_MASKS[key]
    blk = 128
    nb = S // blk
    if S % blk:
        bm = create_block_mask(mask_mod, 1, len(is_sa_q), S, S, device=DEV)
        _BLOCK_MASKS[key] = bm
        return bm
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
    _BLOCK_MASKS[key] = bm
    return bm


def flex_compiled(kind: str):
    """torch.compile'd flex_attention (never the eager path: it materialises S x S scores). The hybrid
    call is static (one compile per sequence length and head_dim, not per
    share: the mask reads its flags from a tensor); the split's SA-only call is dynamic."""
    from torch.nn.attention.flex_attention import flex_attention

    if DEV.type != "cuda":
        return flex_attention
    if kind not in _FLEX:
        import torch._dynamo

        cfg = torch._dynamo.config
        cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
        if hasattr(cfg, "accumulated_cache_size_limit"):
            cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)
        if hasattr(cfg, "fail_on_cache_limit_hit"):
            cfg.fail_on_cache_limit_hit = True  # an error, not a silent eager fallback that OOMs
        _FLEX[kind] = torch.compile(flex_attention, dynamic=(kind == "split"))
    return _FLEX[kind]


def flex_hybrid_fn(x: dict, share: float):
    is_sa_q = [s for s in sa_heads(share) for _ in range(HQ // HKV)]
    set_sa_flags(is_sa_q)
    bm = flex_block_mask(x["qT"].shape[2], is_sa_q, _hybrid_mask_mod)
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
        bm = flex_block_mask(q2.shape[2], [True] * q2.shape[1], _ssa_mask_mod)
        flex = flex_compiled("split")
        calls.append(lambda: flex(q2, k2, v2, block_mask=bm, enable_gqa=True))
    return lambda: [c() for c in calls]


# the prefill config used for "ours" after the tune section (block size of the cache + kernel options)
OURS = {"bs": 16}


# tuned per head_dim (the tune sections); a head_dim without its own tuning uses OURS
OURS_BY_D: dict[int, dict] = {}


def ours_cfg(d: int) -> dict:
    return dict(OURS_BY_D.get(d, OURS))


def fa3_fn(x: dict, bs: int):
    """vLLM's own FlashAttention-3 (``vllm.vllm_flash_attn``, what its FLASH_ATTN backend runs on Hopper), dense
    causal over the same paged cache as ours at ``bs``. Needs the staged vLLM (PYTHONPATH=/tmp/vsite on the GPU
    machine); raises RuntimeError with the reason when it is not there."""
    if DEV.type != "cuda":
        raise RuntimeError("FA3 needs a CUDA GPU")
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func
    except Exception as e:  # ImportError, or vLLM's own import-time errors
        raise RuntimeError(f"vllm.vllm_flash_attn not importable: {e!r}"[:300]) from e
    why = fa_version_unsupported_reason(3)
    if why:
        raise RuntimeError(f"FA3 unsupported here: {why}")
    kc, vc, bt = paged(x, bs)
    S = x["q"].shape[0]
    out = torch.empty_like(x["q"])
    return lambda: flash_attn_varlen_func(
        x["q"], kc, vc, max_seqlen_q=S, cu_seqlens_q=x["qsl"], max_seqlen_k=S, seqused_k=x["sl"],
        softmax_scale=x["q"].shape[-1] ** -0.5, causal=True, block_table=bt, out=out, fa_version=3,
    )  # fmt: skip


def ours_fn(x: dict, share: float, cfg: dict | None = None):
    from elastic_vllm.csrc.prefill import prefill_attention

    cfg = ours_cfg(x["q"].shape[-1]) if cfg is None else dict(cfg)
    kc, vc, bt = paged(x, cfg.pop("bs"))
    hm = head_modes(share)
    out = torch.empty_like(x["q"])
    return lambda: prefill_attention(
        x["q"], kc, vc, bt, x["qsl"], x["sl"], hm, sink=SINK, window=WINDOW, out=out, **cfg
    )


def kernel_resources(jit_fn) -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of a Triton kernel (best effort)."""
    rows = []
    try:
        for cache in jit_fn.device_caches.values():
            for k in cache[0].values():
                k = k.result() if hasattr(k, "result") else k
                md = k.metadata
                consts = getattr(k.src, "constants", {}) if hasattr(k, "src") else {}
                rows.append({
                    "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                    "shared": getattr(md, "shared", None), "num_warps": getattr(md, "num_warps", None),
                    "num_stages": getattr(md, "num_stages", None), "constants": {str(a): str(b) for a, b in consts.items()},
                })  # fmt: skip
    except Exception as e:
        rows.append({"error": repr(e)[:200]})
    return rows


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
    from elastic_vllm.csrc.prefill import prefill_attention

    from elastic_vllm.reference.attention import hybrid_attention_ref

    res = REPORT.setdefault("correctness", [])
    S = 8192 if DEV.type == "cuda" else 256
    x = prefill_inputs(S, 128, seed=1)
    for bs in (16, 128) if DEV.type == "cuda" else (16, 32):
        kc, vc, bt = paged(x, bs)
        for share in (0.0, 0.75):
            hm = head_modes(share)
            out = prefill_attention(x["q"], kc, vc, bt, x["qsl"], x["sl"], hm, sink=SINK, window=WINDOW)
            ref = chunked_reference(x["q"], kc, vc, bt, x["qsl"], x["sl"], hm, SINK, WINDOW)
            base = chunked_reference(x["q"], kc, vc, bt, x["qsl"], x["sl"], hm, SINK, WINDOW, compute_dtype=DT)
            item = {"what": f"prefill {S} d128 bs{bs} SA {share} (default config)", **gate(out, ref, base)}
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
    res.append({"what": "decode B16 ragged sparse", **gate(out, ref, base)})
    log(res[-1])
    save()


# candidates of the tune section, tried at 32K (d 128) in this order; the first is the default path
# at vLLM's usual block size. 128-token blocks are a legitimate cache layout for this backend (vLLM
# lets a backend declare its kernel block sizes); a key tile then lies inside one block (one block-table read).
TUNE_CANDIDATES = [
    {"bs": 16, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"bs": 16, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"bs": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    # two programs per SM (sm_90 build, results/experiments/sm90-build.json: 249 registers at 4 warps, no stack, 112 KB of
    # shared memory, against 255 / 224 KB for the 128 x 128 default): one program's softmax can run under the other's MMAs without warp
    # specialization, at twice the K/V reads from L2 per FLOP (measured slower: 22.10 vs 16.56 ms dense at 32K,
    # kernels-prefill-fa3-h200.json)
    {"bs": 128, "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
]


# head_dim 64 (SmolLM2, Qwen2.5-0.5B...): smaller tiles per FLOP, so fewer warps / more keys per tile
# may win; FlexAttention beat the d-128 winner here (0.86-0.93x in the first runs)
TUNE_CANDIDATES_D64 = [
    {"bs": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"bs": 128, "block_n": 128, "num_warps": 4, "num_stages": 3},
    {"bs": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"bs": 128, "block_n": 128, "num_warps": 4, "num_stages": 4},
    {"bs": 128, "block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
]


def tune_section(d: int = 128) -> None:
    """Time each candidate prefill config at 32K (SA 0 and 0.75), check its output against the first
    candidate's (itself checked against the fp32 reference at 8K by ``correctness``), and use the
    fastest correct one (geometric mean of the two times) for the rest of the run (head_dim d)."""
    global OURS
    from elastic_vllm.csrc.prefill import _prefill_kernel

    rows = REPORT.setdefault("tune", [])
    S = 32768 if DEV.type == "cuda" else 256
    x = prefill_inputs(S, d, seed=3)
    if DEV.type == "cuda":
        cands = TUNE_CANDIDATES if d == 128 else TUNE_CANDIDATES_D64
    else:
        cands = [{"bs": 16, "block_n": 32}, {"bs": 32, "block_n": 32}]
    base_out = {}
    scores = []
    for i, cfg in enumerate(cands):
        row = {"S": S, "d": d, **cfg}
        try:
            t0 = time.perf_counter()
            for share in (0.0, 0.75):
                fn = ours_fn(x, share, cfg)
                out = fn()  # compiles
                if DEV.type == "cuda":
                    torch.cuda.synchronize()
                if share not in base_out:  # the first candidate that ran is the reference of the others
                    base_out[share] = out.clone()
                rel = float((out.float() - base_out[share].float()).norm() / base_out[share].float().norm())
                row[f"rel_diff_vs_first_{share}"] = rel
                if not rel < 1e-2:  # NaN fails too
                    raise RuntimeError(f"output differs from the first candidate's (relative {rel:.3g})")
                r = timeit(fn)
                row[f"ms_{share}"] = r["ms"]
                row[f"TFLOPs_{share}"] = prefill_flops(S, d, share) / (r["ms"] * 1e-3) / 1e12
            row["s"] = round(time.perf_counter() - t0, 1)
            scores.append((math.sqrt(row["ms_0.0"] * row["ms_0.75"]), i))
        except Exception as e:  # e.g. out of shared memory for this config on this Triton
            traceback.print_exc()
            row["error"] = repr(e)[:300]
        rows.append(row)
        log(row)
        save()
    if scores:
        OURS_BY_D[d] = dict(cands[min(scores)[1]])
        if d == 128:
            OURS = OURS_BY_D[d]
    REPORT["ours_config"] = OURS
    REPORT["ours_config_by_head_dim"] = {str(k): v for k, v in OURS_BY_D.items()}
    REPORT["prefill_kernel_variants"] = kernel_resources(_prefill_kernel)
    log(f"ours (d {d}) = {ours_cfg(d)}")
    del x, base_out


def prefill_section(S: int, d: int, shares, extra: dict | None = None) -> None:
    """sdpa dense, then per share: ours (the tuned config), flex one-call hybrid, split; ``extra``
    maps more variants of ours to (config, shares to time it at), e.g. the block-16 default when ours
    uses 128."""
    x = prefill_inputs(S, d)
    rows = REPORT.setdefault("prefill", [])
    sdpa, how = sdpa_fn(x)
    t_sdpa = timeit(sdpa)
    dense_flops = prefill_flops(S, d, 0.0)
    rows.append({"S": S, "d": d, "method": "sdpa_flash_dense", "how": how, **t_sdpa,
                 "TFLOPs": dense_flops / (t_sdpa["ms"] * 1e-3) / 1e12})  # fmt: skip
    log(rows[-1])
    # the bar the issue aims at: vLLM's FA3, dense, over the same paged cache (checked against SDPA first)
    t_fa3 = None
    try:
        fa3 = fa3_fn(x, ours_cfg(d)["bs"])
        a, b = fa3().float(), sdpa()[0].transpose(0, 1).float()
        diff = float((a - b).norm() / b.norm())
        del a, b
        t_fa3 = timeit(fa3)
        rows.append({"S": S, "d": d, "method": "vllm_fa3_dense", "how": "vllm.vllm_flash_attn fa_version=3, paged",
                     "block_size": ours_cfg(d)["bs"], "rel_diff_vs_sdpa": diff, **t_fa3,
                     "TFLOPs": dense_flops / (t_fa3["ms"] * 1e-3) / 1e12})  # fmt: skip
        del fa3
    except Exception as e:
        rows.append({"S": S, "d": d, "method": "vllm_fa3_dense", "error": repr(e)[:300]})
    log(rows[-1])
    save()
    for share in shares:
        flops = prefill_flops(S, d, share)
        res = {}
        fns = {"ours": ours_fn(x, share), "flex_hybrid": flex_hybrid_fn(x, share)}
        if 0.0 < share < 1.0:
            fns["split"] = split_fn(x, share, sdpa)
        for name, (cfg, only) in (extra or {}).items():
            if share in only:
                fns[name] = ours_fn(x, share, cfg)
        for name, fn in fns.items():
            try:
                res[name] = timeit(fn)
            except Exception as e:
                traceback.print_exc()
                res[name] = {"error": repr(e)[:300]}
        try:  # the anchor computes the same function: relative difference of the outputs
            a, b = fns["ours"]().float(), fns["flex_hybrid"]()[0].transpose(0, 1).float()
            res["flex_hybrid"]["rel_diff_vs_ours"] = float((a - b).norm() / a.norm())
            del a, b
        except Exception as e:
            res["flex_hybrid"]["rel_diff_vs_ours"] = repr(e)[:200]
        ours = res["ours"].get("ms")
        for name, r in res.items():
            row = {"S": S, "d": d, "share": share, "method": name, **r}
            if name == "ours":
                row["config"] = ours_cfg(d)
            elif name in (extra or {}):
                row["config"] = extra[name][0]
            if "ms" in r:
                row["TFLOPs"] = flops / (r["ms"] * 1e-3) / 1e12
                if name == "ours":
                    row["x_vs_sdpa"] = t_sdpa["ms"] / r["ms"]
                    if t_fa3:  # dense FA3's time over ours (at share > 0: the hybrid against FA3's dense)
                        row["x_vs_fa3_dense"] = t_fa3["ms"] / r["ms"]
                    for other in ("flex_hybrid", "split"):
                        if "ms" in res.get(other, {}):
                            row[f"x_vs_{other}"] = res[other]["ms"] / r["ms"]
                elif ours:
                    row["ours_speedup"] = r["ms"] / ours
            rows.append(row)
            log(row)
        save()
    del x


def prefill_vllm_section(S: int, d: int, shares, chunk: int) -> None:
    """The prefill kernel as vLLM runs it, next to the ``prefill`` rows' setting (one call, K and V in two
    planes of a [blocks, 2, bs, Hkv, d] cache): (a) the elastic backend's own cache layout in vLLM,
    [blocks, bs, Hkv, 2d] with K and V interleaved per (token, head) (``compat.split_kv_cache``); (b) the
    prompt in chunks of ``chunk`` tokens, one call per chunk, each chunk's queries over every key so far
    (chunked prefill, vLLM's default); (c) both. Inside vLLM at 32K / Omega_MSR 0.75 the kernel took 7.65 ms
    per layer (two 16K chunks, e2e-vllm-h200-llama.json's profile) where the single call takes 6.14 ms."""
    from elastic_vllm.csrc.prefill import prefill_attention

    x = prefill_inputs(S, d)
    cfg = ours_cfg(d)
    bs = cfg.pop("bs")
    kc, vc, bt = paged(x, bs)
    il = torch.cat([kc, vc], dim=-1)  # [blocks, bs, Hkv, 2d]: vLLM's layout for the elastic backend
    layouts = {"planes": (kc, vc), "vllm_interleaved": (il[..., :d], il[..., d:])}
    rows = REPORT.setdefault("prefill_vllm", [])
    for share in shares:
        hm = head_modes(share)
        flops = prefill_flops(S, d, share)
        ref = None
        for lay, (k, v) in layouts.items():
            for n_chunks in (1, S // chunk):
                out = torch.empty_like(x["q"])
                step = S // n_chunks
                calls = []
                for c in range(n_chunks):
                    q0, q1 = c * step, (c + 1) * step
                    calls.append((x["q"][q0:q1], torch.tensor([0, q1 - q0], device=DEV, dtype=torch.int32),
                                  torch.tensor([q1], device=DEV, dtype=torch.int32), out[q0:q1]))  # fmt: skip

                def fn(k=k, v=v, calls=calls, out=out, hm=hm):
                    for q, qsl, sl, o in calls:
                        prefill_attention(q, k, v, bt, qsl, sl, hm, sink=SINK, window=WINDOW, out=o, **cfg)
                    return out

                o = fn().float()
                if ref is None:
                    ref = o.clone()
                r = timeit(fn)
                rows.append({"S": S, "d": d, "share": share, "layout": lay, "chunks": n_chunks, "bs": bs, **r,
                             "TFLOPs": flops / (r["ms"] * 1e-3) / 1e12,
                             "rel_diff_vs_first": float((o - ref).norm() / ref.norm())})  # fmt: skip
                log(rows[-1])
        save()
    del x, il


def timed_after(fn, pre, reps: int = 15) -> dict:
    """ms of ``fn`` alone (CUDA events around it) when each call follows ``pre`` on the stream."""
    if DEV.type != "cuda":
        pre()
        return timeit(fn)
    fn()
    torch.cuda.synchronize()
    ev = []
    for _ in range(reps):
        pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    q = quantiles([a.elapsed_time(b) for a, b in ev])
    return {"ms": q["median"], "p20": q["p20"], "p80": q["p80"]}


def prefill_vllm_context_section(S: int, d: int, share: float, chunk: int) -> None:
    """What else differs inside vLLM, where the kernel took 7.65 ms per layer at 32K / 0.75 against
    6.53 ms here in vLLM's layout and chunks (``prefill vllm layout + chunks``): (a) the queries as a
    strided view of a fused qkv tensor ([T, (Hq + 2 Hkv) d], as vLLM splits it); (b) each call right
    after the layer's four linear layers for a ``chunk``-token step (Llama-3.1-8B shapes), the GPU
    busy and hot as in a prefill, the attention alone timed by events; (c) both. SDPA flash (dense)
    under (b) is the control: a clock or L2 effect shows in any kernel, a layout effect only in ours."""
    from elastic_vllm.csrc.prefill import prefill_attention

    x = prefill_inputs(S, d)
    cfg = ours_cfg(d)
    bs = cfg.pop("bs")
    kc, vc, bt = paged(x, bs)
    il = torch.cat([kc, vc], dim=-1)
    k, v = il[..., :d], il[..., d:]
    qkv = torch.zeros(S, (HQ + 2 * HKV) * d, device=DEV, dtype=DT)
    qkv[:, : HQ * d] = x["q"].reshape(S, HQ * d)
    q_strided = qkv[:, : HQ * d].view(S, HQ, d)
    hm = head_modes(share)
    n = S // chunk

    def ours(q):
        out = torch.empty_like(x["q"])

        def fn():
            for c in range(n):
                q0, q1 = c * chunk, (c + 1) * chunk
                prefill_attention(q[q0:q1], k, v, bt, qsl[c], sl[c], hm, sink=SINK, window=WINDOW, out=out[q0:q1],
                                  **cfg)  # fmt: skip
            return out

        return fn

    qsl = [torch.tensor([0, chunk], device=DEV, dtype=torch.int32) for _ in range(n)]
    sl = [torch.tensor([(c + 1) * chunk], device=DEV, dtype=torch.int32) for c in range(n)]
    hid, inter = (4096, 14336) if DEV.type == "cuda" else (64, 128)
    t = chunk if DEV.type == "cuda" else 16
    xa = torch.randn(t, hid, device=DEV, dtype=DT)
    xb = torch.randn(t, inter, device=DEV, dtype=DT)
    ws = [torch.randn(hid, (HQ + 2 * HKV) * d, device=DEV, dtype=DT), torch.randn(HQ * d, hid, device=DEV, dtype=DT),
          torch.randn(hid, 2 * inter, device=DEV, dtype=DT), torch.randn(inter, hid, device=DEV, dtype=DT)]  # fmt: skip
    xq = torch.randn(t, HQ * d, device=DEV, dtype=DT)

    def linears():
        for _ in range(n):  # one step per chunk: qkv, o, gate_up, down
            xa @ ws[0]
            xq @ ws[1]
            xa @ ws[2]
            xb @ ws[3]

    def idle():  # the control for "after linears": the same stream order, the GPU idle ~10 ms instead
        if DEV.type == "cuda":
            torch.cuda._sleep(20_000_000)

    rows = REPORT.setdefault("prefill_vllm_context", [])
    ref = ours(x["q"])().float()
    flops = prefill_flops(S, d, share)
    for name, q, pre in (("contiguous q", x["q"], None), ("strided q", q_strided, None),
                         ("contiguous q after idle", x["q"], idle), ("contiguous q after linears", x["q"], linears),
                         ("strided q after linears", q_strided, linears)):  # fmt: skip
        fn = ours(q)
        rel = float((fn().float() - ref).norm() / ref.norm())
        r = timed_after(fn, pre) if pre else timeit(fn)
        rows.append({"S": S, "share": share, "chunks": n, "bs": bs, "case": name, **r,
                     "TFLOPs": flops / (r["ms"] * 1e-3) / 1e12, "rel_diff_vs_first": rel})  # fmt: skip
        log(rows[-1])
    sdpa, _how = sdpa_fn(x)
    for name, pre in (("sdpa flash dense", None), ("sdpa flash dense after idle", idle),
                      ("sdpa flash dense after linears", linears)):  # fmt: skip
        r = timed_after(sdpa, pre) if pre else timeit(sdpa)
        rows.append({"S": S, "case": name, **r, "TFLOPs": prefill_flops(S, d, 0.0) / (r["ms"] * 1e-3) / 1e12})
        log(rows[-1])
    save()


def xattn_section(S: int, chunk: int, thresholds=(0.9,)) -> None:
    """XAttention at the Llama-8B shape as vLLM runs it: the prompt's last ``chunk`` queries over all S keys
    (the heaviest chunked-prefill step), block 128 (cache block size and XA block), stride 16. Per mode at
    Omega_MSR 0.75 (FA-SSA, FA-XA, XA-SSA) and all-XA: the block selection alone, the prefill kernel alone
    with that selection, and both; the selected share of the causal blocks. Random q/k (like dummy weights)
    give nearly uniform attention, so the 0.9-mass rule keeps most blocks: the worst case of XA's cost."""
    from elastic_vllm.csrc.prefill import prefill_attention
    from elastic_vllm.csrc.xattn_select import xattn_max_blocks, xattn_select

    x = prefill_inputs(S, 128)
    bs = 128 if DEV.type == "cuda" else 16
    xblock, stride = (128, 16) if DEV.type == "cuda" else (32, 8)
    kc, vc, bt = paged(x, bs)
    q = x["q"][S - chunk :]
    qsl = torch.tensor([0, chunk], device=DEV, dtype=torch.int32)
    sl = torch.tensor([S], device=DEV, dtype=torch.int32)
    mq, mk = xattn_max_blocks(chunk, S, xblock)
    sa = sa_heads(0.75)  # the SA heads of the share, as the prefill sections assign them
    modes = {name: [sa_mode if s else fa_mode for s in sa]
             for name, (fa_mode, sa_mode) in {"FA-SSA": (0, 1), "FA-XA": (0, 2), "XA-SSA": (2, 1),
                                              "all-XA": (2, 2), "all-FA": (0, 0)}.items()}  # fmt: skip
    q0 = S - chunk  # causal blocks of the chunk's query blocks: block a sees a + 1 key blocks
    causal = sum(a + 1 for a in range(q0 // xblock, (S - 1) // xblock + 1))
    rows = REPORT.setdefault("xattn", [])
    out = torch.empty_like(q)
    for name, m in modes.items():
        hm = torch.tensor([m], device=DEV, dtype=torch.int8)
        for thr in thresholds if 2 in m else (None,):

            def sel(hm=hm, thr=thr):
                return xattn_select(q, kc, bt, qsl, sl, hm, max_q_blocks=mq, max_k_blocks=mk, stride=stride,
                                    block=xblock, threshold=thr)  # fmt: skip

            row = {"S": S, "chunk": chunk, "mode": name, "threshold": thr, "bs": bs, "xa_block": xblock,
                   "stride": stride}  # fmt: skip

            def attn(idx=None, cnt=None, hm=hm):
                return prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=SINK, window=WINDOW, out=out,
                                         xa_block_idx=idx, xa_block_cnt=cnt, xattn_block=xblock)  # fmt: skip

            if thr is None:
                row["attn"] = timeit(attn)
            else:
                idx, cnt = sel()
                xa = [h for h in range(HKV) if m[h] == 2]
                row["selected_share"] = float(cnt[0, xa].sum().item() / (len(xa) * causal))
                row["select"] = timeit(sel)
                row["attn"] = timeit(lambda idx=idx, cnt=cnt: attn(idx, cnt))
                row["both"] = timeit(lambda: attn(*sel()))
            rows.append(row)
            log(row)
            save()
    from elastic_vllm.csrc.prefill import _prefill_kernel
    from elastic_vllm.csrc.xattn_select import _xattn_select_kernel

    REPORT["xattn_kernels"] = {"select": kernel_resources(_xattn_select_kernel),
                               "prefill": kernel_resources(_prefill_kernel)}  # fmt: skip
    del x


def decode_section(ctx: int, batches) -> None:
    for B in batches:
        decode_batch(ctx, B)
        save()


def decode_inputs(ctx: int, B: int, d: int) -> tuple:
    """A paged [blocks, 2, BS, Hkv, d] cache of B requests of ctx tokens (randomly permuted blocks, block 0
    unused), their block table, queries, lengths and an output buffer."""
    nblk = B * math.ceil(ctx / BS)
    kv = torch.randn(nblk + 1, 2, BS, HKV, d, device=DEV, dtype=DT)
    bt = (torch.randperm(nblk, device=DEV) + 1).to(torch.int32).view(B, -1)
    q = torch.randn(B, HQ, d, device=DEV, dtype=DT)
    sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    return kv, bt, q, sl, torch.empty_like(q)


def decode_batch(ctx: int, B: int) -> None:
    from elastic_vllm.csrc.decode import decode_attention

    rows = REPORT.setdefault("decode", [])
    d = 128
    kv, bt, q, sl, out = decode_inputs(ctx, B, d)
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
    del kv


def graph_time(fn, calls: int = 10) -> dict:
    """ms per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (what vLLM's decode step
    runs: no launch overhead), next to ``timeit`` (eager, one call per L2 flush)."""
    if DEV.type != "cuda":
        return timeit(fn)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    r = timeit(g.replay)
    return {k: v / calls for k, v in r.items()}


def decode_sweep(key: str, shapes, variants, timing: str) -> None:
    """Rows ``REPORT[key]``: for each (ctx, B) of ``shapes`` and each of dense / 75% SSA heads, the decode
    kernel with each kwargs dict of ``variants(ctx, B)`` (the first is the reference of ``rel_diff_vs_first``),
    timed eagerly (``timing`` "eager": ms at the row's top level), from a CUDA graph ("graph") or both."""
    from elastic_vllm.csrc.decode import decode_attention

    rows = REPORT.setdefault(key, [])
    for ctx, B in shapes:
        kv, bt, q, sl, out = decode_inputs(ctx, B, 128)
        for mode, share in (("dense", 0.0), ("sparse", 0.75)):
            hm = head_modes(share).expand(B, HKV).contiguous()
            first = None
            for kw in variants(ctx, B):
                fn = functools.partial(
                    decode_attention, q, kv[:, 0], kv[:, 1], bt, sl, hm, sink=SINK, window=WINDOW, max_seq_len=ctx,
                    out=out, **kw,
                )  # fmt: skip
                o = fn().float()
                first = o.clone() if first is None else first
                row = {
                    "ctx": ctx,
                    "B": B,
                    "mode": mode,
                    **kw,
                    "rel_diff_vs_first": float((o - first).norm() / first.norm()),
                }
                if timing == "eager":
                    row.update(timeit(fn))
                else:
                    row.update(
                        {"graph": graph_time(fn)}
                        if timing == "graph"
                        else {"eager": timeit(fn), "graph": graph_time(fn)}
                    )
                rows.append(row)
                log(row)
        del kv
        save()


def _default_splits(ctx: int, B: int) -> int:
    from elastic_vllm.csrc.decode import decode_num_splits, default_decode_config

    return decode_num_splits(B, HKV, ctx, default_decode_config(128)["block_n"], DEV)


def decode_splits_section() -> None:
    """Split count of the e2e decode shapes (32K x 16, 128K x 4): the default aims at ~32 programs per
    SM over all (request, KV head) pairs; with 75% SSA heads the work sits in the FA heads' 25% of the
    programs, and more splits spread it (SSA heads use only the splits their few tiles need)."""
    mults = (0.25, 0.5, 1, 2)
    decode_sweep("decode_splits", ((32768, 16), (131072, 4)),
                 lambda ctx, B: [{"num_splits": max(1, round(_default_splits(ctx, B) * m))} for m in mults], "eager")  # fmt: skip


def decode_config_section() -> None:
    """Tile configs of the decode kernel (block_n, num_stages, num_warps) at the e2e decode shapes, replayed
    from a CUDA graph as vLLM's decode step runs it; the first row of each shape is the default config."""
    from elastic_vllm.csrc.decode import default_decode_config

    dflt = default_decode_config(128)
    cfgs = [(dflt["block_n"], dflt["num_stages"], dflt["num_warps"])]
    cfgs += [c for c in ((64, 2, 4), (128, 2, 4), (64, 3, 4), (64, 1, 4), (128, 1, 4), (32, 2, 4), (32, 3, 4),
                         (128, 2, 8)) if c != cfgs[0]]  # fmt: skip
    cfgs = cfgs if DEV.type == "cuda" else cfgs[:2]
    shapes = ((32768, 16), (131072, 4), (131072, 16), (32768, 64)) if DEV.type == "cuda" else ((512, 2),)
    decode_sweep("decode_config", shapes, lambda ctx, B: [
        {"block_n": bn, "num_stages": st, "num_warps": nw} for bn, st, nw in cfgs
    ], "graph")  # fmt: skip


def route_all_layers(router, kc, bts, rows, plen, slots, stages=("task", "router")) -> None:
    for layer, bt in enumerate(bts):
        router(kc, bt, rows, plen, slots, layer, stages=stages)


def router_section() -> None:
    from elastic_vllm.csrc.route import Router, _route_router_kernel, _route_task_kernel, pack_router_weights

    from elastic_vllm.router.model import ElasticRouter

    L, d = 32, 128
    torch.manual_seed(0)
    w = pack_router_weights(ElasticRouter(L, d)).to(DEV)
    inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEV)
    rows = REPORT.setdefault("router", [])
    cases = [(8192, 1), (131072, 1), (8192, 8)] if DEV.type == "cuda" else [(512, 1)]
    for S, R in cases:
        nblk = math.ceil(S / BS)
        # one cache per layer would be 32 x S tokens; layers share one cache through different block tables
        kc = torch.randn(nblk + 1, BS, HKV, d, device=DEV, dtype=DT)
        bts = [(torch.randperm(nblk, device=DEV) + 1).to(torch.int32)[None].expand(R, -1) for _ in range(L)]
        req = torch.arange(R, device=DEV, dtype=torch.int32)
        plen = torch.full((R,), S, device=DEV, dtype=torch.int32)
        table = torch.zeros(R, L, HKV, device=DEV, dtype=torch.int8)
        router = Router(w, table, inv_freq=inv, num_kv_heads=HKV, head_dim=d, block_size=BS)
        all_layers = functools.partial(route_all_layers, router, kc, bts, req, plen, req)
        r = timeit(all_layers)
        row = {"prompt": S, "requests": R, "layers": L, "launches_per_layer": 2, "eager": r,
               "slices": [router.ns1, router.ns2]}  # fmt: skip
        if DEV.type == "cuda":
            all_layers()
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                all_layers()
            row["graph"] = timeit(cg.replay)
            row["graph_us_per_layer"] = row["graph"]["ms"] * 1e3 / L
            row["pdl"] = router.pdl
            if router.pdl:  # the same graph with launch 2 as an ordinary launch
                plain = Router(w, table, inv_freq=inv, num_kv_heads=HKV, head_dim=d, block_size=BS, pdl=False)
                route_all_layers(plain, kc, bts, req, plen, req)  # compile outside the capture
                torch.cuda.synchronize()
                g0 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g0):
                    route_all_layers(plain, kc, bts, req, plen, req)
                row["graph_no_pdl"] = timeit(g0.replay)
            # each kernel alone (a graph of its 32 launches), to place the time
            for name, kern in (("task", _route_task_kernel), ("router", _route_router_kernel)):
                row[f"{name}_kernel"] = kernel_resources(kern)
                g1 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g1):
                    route_all_layers(router, kc, bts, req, plen, req, stages=(name,))
                row[f"graph_{name}_only_us_per_layer"] = timeit(g1.replay)["ms"] * 1e3 / L
        rows.append(row)
        log(row)
        save()


def summary() -> None:
    """Short table last: the reply carries the end of the output."""
    pre = REPORT.get("prefill", [])
    print("\nprefill (ms / TFLOP/s; x = ours speedup)")
    for r in pre:
        if r.get("method") == "ours" and "ms" in r:
            print(f"  S={r['S']:>6} d={r['d']} SA {r['share']:<4} ours {r['ms']:8.2f} ms {r['TFLOPs']:6.0f} TF/s"
                  f"  x_sdpa {r.get('x_vs_sdpa', 0):5.2f}  x_flex {r.get('x_vs_flex_hybrid', 0):5.2f}"
                  f"  x_split {r.get('x_vs_split', 0):5.2f}  x_fa3_dense {r.get('x_vs_fa3_dense', 0):5.2f}")  # fmt: skip
        elif r.get("method") == "vllm_fa3_dense":
            what = f"{r['ms']:8.2f} ms {r['TFLOPs']:6.0f} TF/s" if "ms" in r else r.get("error")
            print(f"  S={r['S']:>6} d={r['d']} vLLM FA3 dense {what}")
    for r in REPORT.get("tune", []):
        print(f"  tune {r}")
    for r in REPORT.get("prefill_vllm", []):
        print(f"  prefill vllm S={r['S']} SA {r['share']:<4} {r['layout']:<16} chunks {r['chunks']} {r['ms']:8.2f} ms"
              f" {r['TFLOPs']:6.0f} TF/s rel {r['rel_diff_vs_first']:.1e}")  # fmt: skip
    for r in REPORT.get("decode", []):
        print(f"  decode ctx={r['ctx']} B={r['B']} {r['mode']:<6} {r['ms']:.3f} ms {r['TBps']:.2f} TB/s"
              f" {r.get('x_vs_dense', '')}")  # fmt: skip
    for r in REPORT.get("decode_splits", []):
        print(f"  decode splits ctx={r['ctx']} B={r['B']} {r['mode']:<6} ns={r['num_splits']:<4} {r['ms']:.3f} ms")
    for r in REPORT.get("prefill_vllm_context", []):
        print(f"  prefill vllm context S={r['S']} {r['case']:<32} {r['ms']:8.2f} ms {r['TFLOPs']:6.0f} TF/s"
              f" rel {r.get('rel_diff_vs_first', 0):.1e}")  # fmt: skip
    for r in REPORT.get("decode_config", []):
        print(f"  decode config ctx={r['ctx']} B={r['B']} {r['mode']:<6} bn={r['block_n']:<4} stages={r['num_stages']}"
              f" warps={r['num_warps']} graph {r['graph']['ms']:.4f} ms rel {r['rel_diff_vs_first']:.1e}")  # fmt: skip
    for r in REPORT.get("router", []):
        g = r.get("graph", {}).get("ms")
        print(f"  router prompt={r['prompt']} R={r['requests']} eager {r['eager']['ms']:.3f} ms graph {g} ms"
              f" task-only {r.get('graph_task_only_us_per_layer')} us/layer router-only"
              f" {r.get('graph_router_only_us_per_layer')} us/layer")  # fmt: skip
    print(f"  ours config {REPORT.get('ours_config')}; errors {REPORT.get('errors')}")


def main() -> int:
    global ARGS, DEV, DT, SINK, WINDOW
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<time>.json)")
    ap.add_argument("--quick", action="store_true", help="reduced grid: 32K/128K, SA 0/0.75, d 128")
    ap.add_argument("--sections", default="",
                    help="comma-separated name filters (e.g. 'decode,router'); on a GPU the correctness gate runs "
                         "first always, and prefill sections time the tuned config only when 'tune' runs too")  # fmt: skip
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
    REPORT.update({"env": environment(), "config": {"Hq": HQ, "Hkv": HKV, "sink": SINK, "window": WINDOW,
                   "block_size_default": BS, "dtype": str(DT), "quick": ARGS.quick}})  # fmt: skip
    log(REPORT["env"])
    save()
    dry = ARGS.cpu_dry
    shares = (0.0, 0.75) if ARGS.quick else (0.0, 0.5, 0.75, 1.0)
    section("ceilings", ceilings)
    # the gate: no kernel is timed unless prefill and decode match the fp32 reference (flash-attention rule)
    section("correctness", correctness)
    bad = [c for c in REPORT.get("correctness", []) if not c["ok"]] or REPORT.get("errors")
    if bad:
        log(f"correctness gate failed, nothing timed: {bad}")
        return 1
    section("tune", tune_section)
    extra = {} if OURS.get("bs") == 16 else {"ours_bs16_default": ({"bs": 16}, (0.75,))}
    section("prefill S=32768 d=128", lambda: prefill_section(32768 if not dry else 256, 128, shares))
    vshares = (0.0, 0.75) if not dry else (0.75,)
    section("prefill vllm layout + chunks", lambda: prefill_vllm_section(
        32768 if not dry else 256, 128, vshares, 16384 if not dry else 128))  # fmt: skip
    section("prefill vllm context", lambda: prefill_vllm_context_section(
        32768 if not dry else 128, 128, 0.75, 16384 if not dry else 64))  # fmt: skip
    if not dry:
        section("prefill S=131072 d=128", lambda: prefill_section(131072, 128, shares, extra))
        section("decode 32K", lambda: decode_section(32768, (1, 16, 64)))
        section("decode 128K", lambda: decode_section(131072, (1, 16, 64)))
        section("decode splits", decode_splits_section)
    else:
        section("decode 512", lambda: decode_section(512, (2,)))
    section("decode config", decode_config_section)
    section("router", router_section)
    if not dry:
        section("xattn S=32768", lambda: xattn_section(32768, 16384, (0.9, 0.3)))
        section("xattn S=131072", lambda: xattn_section(131072, 16384, (0.9, 0.3)))
    else:
        section("xattn S=256", lambda: xattn_section(256, 128, (0.9, 0.3)))
    if not ARGS.quick and not dry:
        section("prefill S=8192 d=128", lambda: prefill_section(8192, 128, shares))
        section("tune d64", lambda: tune_section(64))
        section("prefill S=32768 d=64", lambda: prefill_section(32768, 64, shares))
        section("prefill S=131072 d=64", lambda: prefill_section(131072, 64, (0.0, 0.75)))
        section("prefill S=262144 d=128", lambda: prefill_section(262144, 128, (0.0, 0.75)))
    save()
    summary()
    log(f"done: {len(REPORT.get('errors', []))} section errors -> {ARGS.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
