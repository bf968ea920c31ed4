"""Engine-start warm-up of the Triton path, and the check that admits vLLM's FlashAttention for all-FA steps.

Why: vLLM's profile run calls attention without metadata and its CUDA-graph capture runs only short decode
batches, so without this the first real requests compiled the prefill, router and XAttention kernels and
the decode merge kernel of every new split count, inside the request (vLLM's JIT monitor reported
``_prefill_kernel``; the first 1K-prompt burst at concurrency 64 had a p99 TTFT of 11.7 s against 1.6 s for
FLASH_ATTN). Here every kernel variant the engine can launch is compiled once, on synthetic data laid out
exactly as vLLM's paged cache (same strides, dtypes and constexprs), before the server answers /health;
the kernels specialise on nothing that varies between steps (see ``elastic_vllm.ops``), so no request compiles.

The same synthetic batch (two prompt rows and a decode row, all heads FA) then runs through vLLM's
FlashAttention and through the elastic kernels: only if both agree (relative error under
``DENSE_CHECK_RTOL``) do all-FA steps (:func:`state.row_is_dense`) go to vLLM's kernel. Otherwise the
reason is logged as a warning and those steps stay on the elastic kernels (the same math, slower).

With the same check on a checkerboard of FA and SSA heads, hybrid prompt steps send their FA heads to
vLLM's FlashAttention (one call per KV head, :func:`ops.fa_heads_attention`) and only the SA heads to the
fused kernel, whose FA tiles run at 0.81x FA3's rate (32K dense, one layer on the H200: 16.6 ms vs 13.3 ms).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch

from elastic_vllm import ops as kernels
from elastic_vllm.config import HeadMode
from elastic_vllm.ops._common import num_sms
from elastic_vllm.vllm_plugin import compat

if kernels.AVAILABLE:  # the warm-up runs on the Triton path only
    from elastic_vllm.ops.decode import kernel as decode_kernel

logger = logging.getLogger("elastic_vllm.vllm_plugin")

DENSE_ENV = "ELASTIC_VLLM_FLASH_DENSE"  # "auto" (default): all-FA steps on vLLM's FlashAttention; "off"
# bf16 inputs, fp32 accumulation in both kernels: they differ by ~2e-3 relative; a wrong layout or mask
# differs by O(1)
DENSE_CHECK_RTOL = 2e-2
PROMPT_LENS = (300, 45)  # two prompt rows: more than one query tile, and a ragged one
DECODE_LEN = 200


def dense_requested() -> bool:
    v = os.environ.get(DENSE_ENV, "auto").lower()
    if v not in ("auto", "off"):
        raise ValueError(f"{DENSE_ENV}: must be 'auto' or 'off' (got {v!r})")
    return v == "auto"


def _synthetic_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype, device):
    """Key / value views laid out as vLLM hands them to the backend (``compat.split_kv_cache`` of the
    logical [num_blocks, H, block_size, 2*D] NHD cache), filled with unit normals (never zeros)."""
    kv = torch.randn(num_blocks, block_size, hkv, 2 * d, dtype=dtype, device=device).transpose(1, 2)
    return compat.split_kv_cache(kv, d)


def _batch(seq_lens: list[int], q_lens: list[int], block_size: int, num_blocks: int, device):
    """query_start_loc, seq_lens and a block table of distinct, shuffled blocks (block 0 unused)."""
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks - 1)[: sum(need)] + 1
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device)


def router_warmup_rows(route_row) -> list[list]:
    """The routing rows the warm-up routes, one list per compiled variant of the router kernels: rows of different
    biases through the fused kernel (its epilogue takes a threshold per row, so a client's ``elastic_bias`` or a
    load-policy level compiles nothing while serving), and a row with a fixed SA budget (``elastic_target_omega``:
    the kernel's logits, then the torch glue)."""
    a, b = PROMPT_LENS
    return [
        [route_row(1, a, "auto", False, None, bias=0.0), route_row(2, b, "auto", False, None, bias=1.0)],
        [route_row(1, a, "auto", False, None, target=0.5), route_row(2, b, "auto", False, None)],
    ]


def maybe_warm_up(st, kv_cache_spec, vllm_config) -> dict | None:
    """Once per engine, on the Triton path on a GPU (the interpreter compiles nothing)."""
    from elastic_vllm.ops._common import interpret

    if st.warmed or st.ops != "triton" or st.device.type != "cuda" or interpret():
        return None
    st.warmed = True
    heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
    return warm_up(st, kv_cache_spec.dtype, heads, kv_cache_spec.head_size)


def warm_up(st, dtype: torch.dtype, num_q_heads: int, head_size: int) -> dict:
    """Compile every kernel variant ``st`` (an attached ``EngineState`` on the Triton path) can launch, then
    admit vLLM's FlashAttention for all-FA steps if it agrees with the elastic kernels. Returns what ran."""
    from elastic_vllm.vllm_plugin.ops import triton_attention
    from elastic_vllm.vllm_plugin.routing import RouteRow, build_route_batch

    t0 = time.perf_counter()
    dev, bs, hkv, d = st.device, st.block_size, st.num_kv_heads, head_size
    cfg = st.cfg
    p = st.params
    scale = d**-0.5
    dec_bn = decode_kernel.default_decode_config(d)["block_n"]
    # decode: one split kernel and a merge kernel per power of two of the split count, up to its cap
    max_splits = min(num_sms(dev), 256)
    splits = sorted({min(1 << i, max_splits) for i in range(max(max_splits - 1, 0).bit_length() + 1)})
    longest = max(max(splits) * dec_bn, *PROMPT_LENS, DECODE_LEN)
    num_blocks = 2 + 2 * -(-longest // bs) + sum(-(-s // bs) for s in (*PROMPT_LENS, DECODE_LEN))
    gen = torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [])
    with gen, torch.no_grad():
        torch.manual_seed(0)
        key_cache, value_cache = _synthetic_cache(num_blocks, bs, hkv, d, dtype, dev)
        for ns in splits:
            qsl, sl, bt = _batch([ns * dec_bn], [1], bs, num_blocks, dev)
            q = torch.randn(1, num_q_heads, d, dtype=dtype, device=dev)
            modes = torch.full((1, hkv), int(cfg.sa_mode), dtype=torch.int32, device=dev)
            modes[:, 0] = int(cfg.fa_mode)
            decode_kernel.decode_attention(q, key_cache, value_cache, bt, sl, modes, sink=p.sink, window=p.window,
                                    max_seq_len=ns * dec_bn, scale=scale, num_splits=ns)  # fmt: skip
        # a mixed step as the engine runs it: one decode row first, then two prompt rows
        seq = [DECODE_LEN, *PROMPT_LENS]
        q_lens = [1, *PROMPT_LENS]
        qsl, sl, bt = _batch(seq, q_lens, bs, num_blocks, dev)
        T = sum(q_lens)
        q = torch.randn(T, num_q_heads, d, dtype=dtype, device=dev)
        mixed = torch.full((len(seq), hkv), int(cfg.sa_mode), dtype=torch.int32, device=dev)
        mixed[:, 0] = int(cfg.fa_mode)
        out = torch.empty_like(q)
        pq = qsl[1:] - 1
        wp = replace(p, scale=scale)
        triton_attention(q, key_cache, value_cache, bt, qsl, sl, mixed, wp, out, 1, 1, max(q_lens), max(seq),
                         cfg.uses_xattn, pq)  # fmt: skip
        if st.router is not None and st.kernel_router is not None:
            # the router kernels (the routing writes row_modes of this layer: rewritten by every step's plan), once
            # per variant: the fused epilogue, and the logits of the budget glue
            for rows in router_warmup_rows(RouteRow):
                rb = build_route_batch(rows, bt, bs, cfg.pooling, cfg.pool_tokens, budget_sa=st.budget_counts)
                st.route(0, key_cache, rb)
        report = {"compile_s": 0.0, "dense": None, "dense_reason": "", "fa_split": None}
        if dense_requested():
            report.update(_admit_dense(st, dtype, d, q, key_cache, value_cache, bt, qsl, sl, q_lens, seq, wp))
            if st.dense_attention is not None and cfg.fa_mode == HeadMode.FA:
                report.update(_admit_fa_split(st, q, key_cache, value_cache, bt, qsl, sl, q_lens, seq, wp))
        else:
            report["dense_reason"] = f"{DENSE_ENV}=off"
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    report["compile_s"] = round(time.perf_counter() - t0, 2)
    logger.info(
        "elastic: kernels warmed up in %.1f s (decode splits %s); all-FA steps: %s; FA heads of hybrid steps: %s",
        report["compile_s"],
        splits,
        report["dense"] or f"elastic kernels ({report['dense_reason']})",
        report["fa_split"] or "elastic kernels",
    )
    return report


def _admit_dense(st, dtype, d, q, key_cache, value_cache, bt, qsl, sl, q_lens, seq, p) -> dict:
    """Set ``st.dense_attention`` when vLLM's FlashAttention computes what the elastic kernels compute with
    every head FA on the synthetic batch; else leave it None and log why."""
    from elastic_vllm.vllm_plugin.ops import triton_attention

    fn, what = compat.flash_attn_dense(dtype, d)
    if fn is None:
        logger.warning("elastic: all-FA steps stay on the elastic kernels: %s", what)
        return {"dense": None, "dense_reason": what}
    fa = torch.full((len(seq), st.num_kv_heads), int(HeadMode.FA), dtype=torch.int32, device=q.device)
    ref = torch.empty_like(q)
    triton_attention(q, key_cache, value_cache, bt, qsl, sl, fa, p, ref, 1, 1, max(q_lens), max(seq), False,
                     qsl[1:] - 1)  # fmt: skip
    got = torch.full_like(q, float("nan"))
    try:
        fn(q, key_cache, value_cache, got, qsl, sl, bt, max(q_lens), max(seq), p.scale)
    except Exception as e:  # e.g. a layout this FlashAttention build rejects: a reason, not a crash
        why = f"{what} failed on the paged cache ({e!r:.300})"
        logger.warning("elastic: all-FA steps stay on the elastic kernels: %s", why)
        return {"dense": None, "dense_reason": why}
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    if not err < DENSE_CHECK_RTOL:  # NaN (an unwritten output) fails too
        why = f"{what} disagrees with the elastic kernels (relative error {err:.3g} > {DENSE_CHECK_RTOL})"
        logger.warning("elastic: all-FA steps stay on the elastic kernels: %s", why)
        return {"dense": None, "dense_reason": why, "dense_rel_err": err}
    st.dense_attention = fn
    return {"dense": what, "dense_rel_err": err}


def _admit_fa_split(st, q, key_cache, value_cache, bt, qsl, sl, q_lens, seq, p) -> dict:
    """Set ``st.fa_heads_attention`` (the admitted dense kernel) when a hybrid step with its FA heads on it
    (``ops.fa_heads_attention`` + the hybrid prefill with ``skip_fa``) computes what the elastic kernels alone
    compute; else log why. The modes alternate FA / SA over (row, head), so every head's dense call has rows it
    computes and rows it gets no keys for. This also compiles the ``skip_fa`` variant."""
    from elastic_vllm.vllm_plugin.ops import triton_attention

    fn = st.dense_attention
    B, hkv = len(seq), st.num_kv_heads
    grid = torch.arange(B)[:, None] + torch.arange(hkv)[None, :]
    modes = torch.where(grid % 2 == 0, int(st.cfg.fa_mode), int(st.cfg.sa_mode)).to(torch.int32).to(q.device)
    args = (max(q_lens), max(seq), st.cfg.uses_xattn, qsl[1:] - 1)
    ref = torch.full_like(q, float("nan"))
    triton_attention(q, key_cache, value_cache, bt, qsl, sl, modes, p, ref, 1, 1, *args)
    got = torch.full_like(q, float("nan"))
    try:
        triton_attention(q, key_cache, value_cache, bt, qsl, sl, modes, p, got, 1, 1, *args, fn)
    except Exception as e:  # a reason, not a crash: the hybrid kernel keeps every head
        why = f"the FA-heads split failed ({e!r:.300})"
        logger.warning("elastic: FA heads of hybrid steps stay on the elastic kernels: %s", why)
        return {"fa_split": None, "fa_split_reason": why}
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    if not err < DENSE_CHECK_RTOL:
        why = f"the FA-heads split disagrees with the elastic kernels (relative error {err:.3g} > {DENSE_CHECK_RTOL})"
        logger.warning("elastic: FA heads of hybrid steps stay on the elastic kernels: %s", why)
        return {"fa_split": None, "fa_split_reason": why, "fa_split_rel_err": err}
    st.fa_heads_attention = fn
    return {"fa_split": "vLLM FlashAttention per KV head", "fa_split_rel_err": err}
