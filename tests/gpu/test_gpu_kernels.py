"""GPU correctness of the Triton kernels at real shapes (Llama-3.1-8B attention: 32 q / 8 KV heads, d 128).

    TRITON_INTERPRET=0 python3 -m pytest tests/gpu/test_gpu_kernels.py --gpu-out $OUT/check_kernels.json

One row per case (name, error, bound, seconds). Tolerances: bf16 follows the flash-attention rule, max |kernel - fp32
reference| <= 2 x max |PyTorch-in-bf16 - fp32 reference| + 1e-3; fp32 uses an explicit 1e-4. ``--cpu-dry`` runs the
same cases at toy sizes under TRITON_INTERPRET=1 (float16: the interpreter mishandles bf16).
"""

from __future__ import annotations

import types

import pytest
import torch

from elastic_vllm.reference.attention import gather_paged, hybrid_attention_chunked, hybrid_attention_ref
from elastic_vllm.reference.paged import make_paged

pytestmark = pytest.mark.gpu(cpu_dry=True)


def sizer(dry: bool):
    """Real size on the GPU, a toy one under --cpu-dry."""
    return (lambda n: max(1, n // 128) + (n % 128 > 0)) if dry else (lambda n: n)


@pytest.fixture(scope="module")
def half(cpu_dry):
    return torch.float16 if cpu_dry else torch.bfloat16


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def tol(dtype, base_err: float) -> float:
    return 1e-4 if dtype == torch.float32 else 2 * base_err + 1e-3


def record_err(record, name, err, bound, ok=None, **numbers):
    ok = bool(err <= bound) if ok is None else ok
    record(name, ok, err=float(err), bound=float(bound), **numbers)
    assert ok, f"{name}: error {err:.3g} > bound {bound:.3g} {numbers}"


def build_batch(dev, seqs, qls, hq, hkv, d, bs, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = [torch.randn(s, hkv, d, generator=g).to(dev, dtype) for s in seqs]
    vals = [torch.randn(s, hkv, d, generator=g).to(dev, dtype) for s in seqs]
    kc, vc, bt = make_paged(keys, vals, bs, g)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qls), 0)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dev, dtype)
    return q, kc, vc, bt, qsl.to(dev), torch.tensor(seqs, dtype=torch.int32, device=dev)


def modes_for(dev, B, hkv, sa_share, sa_mode=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(B, hkv, dtype=torch.int8)
    n_sa = round(sa_share * hkv)
    for b in range(B):
        m[b, torch.randperm(hkv, generator=g)[:n_sa]] = sa_mode
    return m.to(dev)


def poison_past_seq_len(kc, vc, bt, seqs):
    """NaN in every cache slot no request holds (past each seq_len, and unused blocks): a kernel that reads a
    key or value there, even multiplied by zero, returns NaN."""
    bs = kc.shape[1]
    held = torch.zeros(kc.shape[0], bs, dtype=torch.bool, device=kc.device)
    for b, s in enumerate(seqs):
        pos = torch.arange(s, device=kc.device)
        held[bt[b, pos // bs].long(), pos % bs] = True
    kc[~held] = float("nan")
    vc[~held] = float("nan")


# --- prefill --------------------------------------------------------------------------------------------------
# name -> (seqs, query lens, hq, hkv, d, block size, dtype ("half" / "fp32"), sink, window, SA share, options),
# a function of (size, dry): the GPU shape, or a toy one under --cpu-dry
PREFILL = {
    "prefill 8K bf16 d128 GQA4 50% SSA bs16":
        lambda sz, dry: ([sz(8192)], [sz(8192)], 32, 8, 128, 16, "half", 128, sz(2048), 0.5, {}),
    "prefill varlen+chunked bf16 d128 mixed bs16":
        lambda sz, dry: ([30, 63, 50, 17, 1], [30, 63, 12, 1, 1], 8, 2, 32, 16, "half", 4, 9, 0.5, {}) if dry else
        ([3000, 1023, 5000, 17, 1], [3000, 1023, 1200, 1, 1], 32, 8, 128, 16, "half", 128, 512, 0.5, {}),
    "prefill varlen+chunked fp32 d128 mixed bs16":
        lambda sz, dry: ([30, 63], [30, 13], 8, 2, 32, 16, "fp32", 4, 9, 0.5, {}) if dry else
        ([3000, 1023, 1200], [3000, 511, 1], 32, 8, 128, 16, "fp32", 128, 512, 0.5, {}),
    "prefill 4K bf16 d64 GQA8 75% SSA bs16":
        lambda sz, dry: ([sz(4096)], [sz(4096)], 16, 2, 64, 16, "half", 64, sz(1024), 0.75, {}),
    "prefill varlen bf16 d128 bs128 (tile in block)":
        lambda sz, dry: ([sz(4096), sz(2500)], [sz(4096), sz(700)], 32, 8, 128, 128, "half", 128, sz(1024), 0.5, {}),
    "prefill varlen+chunked bf16 d128 mixed bs128, NaN past seq_len":
        lambda sz, dry: ([30, 63, 50, 17, 1], [30, 63, 12, 1, 1], 8, 2, 32, 32, "half", 4, 9, 0.5,
                         {"poison": True, "block_m": 16, "block_n": 16}) if dry else
        ([3000, 1023, 5000, 17, 1], [3000, 1023, 1200, 1, 1], 32, 8, 128, 128, "half", 128, 512, 0.5, {"poison": True}),
    "prefill 32K bf16 d128 75% SSA (sink128 w2048) bs16":
        lambda sz, dry: ([sz(32768)], [sz(32768)], 32, 8, 128, 16, "half", 128, sz(2048), 0.75, {}),
    "prefill varlen+chunked bf16 d128 bs128":
        lambda sz, dry: ([sz(8192), sz(3000), sz(700)], [sz(8192), sz(1000), sz(700)], 32, 8, 128, 128, "half", 128,
                         sz(2048), 0.75, {}),
    "prefill 8K bf16 d128 bs64 block_n 64":
        lambda sz, dry: ([sz(8192)], [sz(8192)], 32, 8, 128, 64, "half", 128, sz(2048), 0.5, {"block_n": 64}),
    "prefill 8K bf16 d64 GQA4 bs128 default config":
        lambda sz, dry: ([sz(8192)], [sz(8192)], 32, 8, 64, 128, "half", 128, sz(2048), 0.5, {}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill(name, cpu_dry, dev, half, record):
    from elastic_vllm.ops.prefill.kernel import prefill_attention

    seqs, qls, hq, hkv, d, bs, dt, sink, window, share, kw = PREFILL[name](sizer(cpu_dry), cpu_dry)
    dtype = torch.float32 if dt == "fp32" else half
    poison = kw.pop("poison", False)
    q, kc, vc, bt, qsl, sl = build_batch(dev, seqs, qls, hq, hkv, d, bs, dtype)
    if poison:
        poison_past_seq_len(kc, vc, bt, seqs)
    hm = modes_for(dev, len(seqs), hkv, share)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=sink, window=window, out=out, **kw)
    ref = hybrid_attention_chunked(q, kc, vc, bt, qsl, sl, hm, sink, window)
    base = 0.0
    if dtype != torch.float32:
        base = max_err(hybrid_attention_chunked(q, kc, vc, bt, qsl, sl, hm, sink, window, compute_dtype=dtype), ref)
    err = float("inf") if bool(torch.isnan(out).any()) else max_err(out, ref)
    record_err(record, name, err, tol(dtype, base), torch_bf16_err=base)


def test_prefill_dense_vs_sdpa_flash(cpu_dry, dev, half, record):
    """Ours and SDPA flash (both bf16) against one fp32 reference on the same rows (the first and the last n
    queries: large outputs early, 32K-key averages late); flash-attention rule on SDPA's error."""
    import torch.nn.functional as F

    from elastic_vllm.ops.prefill.kernel import prefill_attention

    S = sizer(cpu_dry)(32768)
    q, kc, vc, bt, qsl, sl = build_batch(dev, [S], [S], 32, 8, 128, 16, half, seed=1)
    hm = modes_for(dev, 1, 8, 0.0)
    out = prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048)
    k = gather_paged(kc, bt[0], S).transpose(0, 1)[None].repeat_interleave(4, 1)
    v = gather_paged(vc, bt[0], S).transpose(0, 1)[None].repeat_interleave(4, 1)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)[0].transpose(0, 1)
    n = min(1024, S)
    qn = torch.tensor([0, n], device=dev, dtype=torch.int32)
    first = hybrid_attention_chunked(q[:n], kc, vc, bt, qn, torch.tensor([n], device=dev, dtype=torch.int32), hm, 0, 1)
    last = hybrid_attention_chunked(q[-n:], kc, vc, bt, qn, sl, hm, 0, 1)
    err = max(max_err(out[:n], first), max_err(out[-n:], last))
    base = max(max_err(want[:n], first), max_err(want[-n:], last))
    record_err(record, "prefill 32K dense vs SDPA flash", err, tol(half, base), sdpa_vs_fp32=base,
               ours_vs_sdpa=max_err(out, want))  # fmt: skip


# --- XAttention: the selection against its reference, then the attention over the selection --------------------
@pytest.mark.parametrize(
    ("name", "q_len"), [("xattn 8K FA-XA tau0.9", 8192), ("xattn 8K chunk of 3000 mid-block", 3000)]
)
def test_xattn(name, q_len, cpu_dry, dev, half, record):
    from elastic_vllm.ops.prefill.kernel import prefill_attention
    from elastic_vllm.ops.xattn_select.kernel import lists_to_block_masks, xattn_max_blocks, xattn_select
    from elastic_vllm.ops.xattn_select.naive import xattn_block_mask_ref

    sz = sizer(cpu_dry)
    S, q_len = sz(8192), sz(q_len) + (3 if q_len != 8192 else 0)
    hq, hkv, d, bs, thr = 32, 8, 128, 16, 0.9
    stride, blk = (4, 16) if cpu_dry else (16, 128)
    q, kc, vc, bt, qsl, sl = build_batch(dev, [S], [q_len], hq, hkv, d, bs, half, seed=2)
    hm = modes_for(dev, 1, hkv, 0.5, sa_mode=2)  # FA-XA: half the heads XA
    mq, mk = xattn_max_blocks(q_len, S, blk)
    idx, cnt = xattn_select(q, kc, bt, qsl, sl, hm, max_q_blocks=mq, max_k_blocks=mk, stride=stride, block=blk,
                            threshold=thr)  # fmt: skip
    masks = lists_to_block_masks(idx, cnt, [S], [q_len], blk)
    g = hq // hkv
    rows = same = 0
    lo = (S - q_len) // blk
    k = gather_paged(kc, bt[0], S)
    for h in range(hkv):
        if int(hm[0, h]) != 2:
            continue
        want = xattn_block_mask_ref(q[:, h * g : (h + 1) * g], k[:, h], S - q_len, stride, blk, thr).cpu()
        for a in range(lo, (S - 1) // blk + 1):
            rows += 1
            same += bool(torch.equal(masks[0][h][a], want[a]))
    # near-threshold rows may differ (summation order); require >= 98% identical rows
    sel_ok = 1 - same / max(rows, 1) <= 0.02
    record(name + " selection rows", sel_ok, err=1 - same / max(rows, 1), bound=0.02, rows=rows)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc, vc, bt, qsl, sl, hm, sink=128, window=2048, out=out, xa_block_idx=idx,
                      xa_block_cnt=cnt, xattn_block=blk)  # fmt: skip
    dm = [m.to(dev) for m in masks]
    xa = {"xa_block_masks": dm, "xa_block": blk}
    ref = hybrid_attention_chunked(q, kc, vc, bt, qsl, sl, hm, 128, 2048, **xa)
    base = max_err(hybrid_attention_chunked(q, kc, vc, bt, qsl, sl, hm, 128, 2048, **xa, compute_dtype=q.dtype), ref)
    err = float("inf") if bool(torch.isnan(out).any()) else max_err(out, ref)
    record_err(record, name + " attention", err, tol(q.dtype, base))
    assert sel_ok, f"{name}: {rows - same} of {rows} selection rows differ from the reference"


# --- decode ---------------------------------------------------------------------------------------------------
DECODE = {
    "decode B16 ragged to 32K bf16 50% SSA":
        lambda sz: ([sz(n) for n in (1, 63, 113, 1023, 4096, 8191, 32768, 20000) * 2], 32, 8, 128, 16, "half", 128,
                    sz(2048), 0.5),
    "decode B4 128K bf16 dense":
        lambda sz: ([sz(131072), sz(131072) - 5, sz(70000), sz(1000)], 32, 8, 128, 16, "half", 128, sz(2048), 0.0),
    "decode B4 128K bf16 75% SSA":
        lambda sz: ([sz(131072), sz(131072) - 5, sz(70000), sz(1000)], 32, 8, 128, 16, "half", 128, sz(2048), 0.75),
    "decode B8 fp32 d64 GQA4 bs64":
        lambda sz: ([sz(n) for n in (5000, 100, 17, 9000) * 2], 16, 4, 64, 64, "fp32", 64, sz(512), 0.5),
}  # fmt: skip


def _decode(dev, dtype, seqs, hq, hkv, d, bs, sink, window, share, graph=False):
    from elastic_vllm.ops.decode.kernel import decode_attention

    q, kc, vc, bt, qsl, sl = build_batch(dev, seqs, [1] * len(seqs), hq, hkv, d, bs, dtype, seed=3)
    hm = modes_for(dev, len(seqs), hkv, share)
    mx = max(seqs)
    kw = dict(sink=sink, window=window, max_seq_len=mx)
    if graph:  # capture at full lengths, then shrink seq_lens in place and replay (what vLLM's graphs do)
        out = torch.empty_like(q)
        decode_attention(q, kc, vc, bt, sl, hm, out=out, **kw)
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            decode_attention(q, kc, vc, bt, sl, hm, out=out, **kw)
        sl.copy_((sl * 2) // 3)
        out.fill_(float("nan"))
        cg.replay()
        torch.cuda.synchronize()
    else:
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kc, vc, bt, sl, hm, out=out, **kw)
    ref = hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, sink, window)
    base = 0.0
    if dtype != torch.float32:
        base = max_err(hybrid_attention_ref(q, kc, vc, bt, qsl, sl, hm, sink, window, compute_dtype=dtype), ref)
    err = float("inf") if bool(torch.isnan(out).any()) else max_err(out, ref)
    return err, tol(dtype, base)


@pytest.mark.parametrize("name", list(DECODE))
def test_decode(name, cpu_dry, dev, half, record):
    seqs, hq, hkv, d, bs, dt, sink, window, share = DECODE[name](sizer(cpu_dry))
    dtype = torch.float32 if dt == "fp32" else half
    record_err(record, name, *_decode(dev, dtype, seqs, hq, hkv, d, bs, sink, window, share))


@pytest.mark.gpu  # CUDA graphs: no --cpu-dry variant
def test_decode_cuda_graph_replay(dev, half, record):
    seqs = [40000, 30000, 2000, 512]
    err, bound = _decode(dev, half, seqs, 32, 8, 128, 16, 128, 2048, 0.5, graph=True)
    record_err(record, "decode CUDA graph replay (seq_lens shrunk in place)", err, bound)


# --- the transformers engine's Triton path ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "decode_step"),
    [
        ("hf triton path: padded prompt B3 4K bf16 50% SSA", False),
        ("hf triton path: padded decode step B3 4K bf16 50% SSA", True),
    ],
)
def test_hf_triton_path(name, decode_step, cpu_dry, dev, half, record):
    """``elastic_vllm.hf.triton_backend`` (the whole batch as 1-token cache blocks, one launch) against the torch path,
    on a left-padded batch as generate() builds it: a prompt (Q == K) or a decode step (Q == 1). Padding keys are NaN
    for the Triton path; the reference is the torch path in fp32, the bound twice the torch path's own error."""
    from elastic_vllm.hf import ops
    from elastic_vllm.hf.attention import _compute

    sz = sizer(cpu_dry)
    B, K, hq, hkv, d, sink, window = 3, sz(4096), 32, 8, 128, 4 if cpu_dry else 128, sz(1024)
    Q = 1 if decode_step else K
    g = torch.Generator(device=dev).manual_seed(11)
    cfg = types.SimpleNamespace(mode="FA-SSA", sink=sink, window=window, xattn_block=128, uses_xattn=False)
    q = torch.randn(B, hq, Q, d, device=dev, dtype=half, generator=g)
    k = torch.randn(B, hkv, K, d, device=dev, dtype=half, generator=g)
    v = torch.randn(B, hkv, K, d, device=dev, dtype=half, generator=g)
    mask = torch.ones(B, K, dtype=torch.long, device=dev)
    for b in range(1, B):
        mask[b, : (K // 3) * b // (B - 1)] = 0  # left padding, up to a third of the row
    modes = modes_for(dev, B, hkv, 0.5).long()
    k_pos, k_valid = ops.token_positions(mask, B, K, dev)
    ctx = [k_pos, k_valid, k_pos[:, K - Q :], k_valid[:, K - Q :], True]
    scale = d**-0.5
    ref = _compute(modes, q.float(), k.float(), v.float(), (*ctx, "torch"), cfg, scale, {})
    base = _compute(modes, q, k, v, (*ctx, "torch"), cfg, scale, {})
    kp = k.masked_fill(~k_valid[:, None, :, None], float("nan"))
    vp = v.masked_fill(~k_valid[:, None, :, None], float("nan"))
    got = _compute(modes, q, kp, vp, (*ctx, "triton"), cfg, scale, {})
    real = ctx[3][:, None, :, None].expand_as(got)
    err, bound = max_err(got[real], ref[real]), tol(half, max_err(base[real], ref[real]))
    record_err(record, name, err, bound, ok=bool(err <= bound and torch.all(got[~real] == 0)))


# --- the fused router -----------------------------------------------------------------------------------------------
ROUTE = {
    "route 4 layers, prompts 8K/150/128K (boundary 100)":
        lambda sz, dry: ([300, 150, 20], 2, "boundary", 100) if dry else ([8192, 150, 131072], 4, "boundary", 100),
    "route 2 layers, whole pooling, prompts 8K/150/20K":
        lambda sz, dry: ([300, 150, 20], 2, "whole", 100) if dry else ([8192, 150, 20000], 2, "whole", 100),
    "route 2 layers, boundary 400 (pooling launch), 128K/900":
        lambda sz, dry: ([300, 90], 2, "boundary", 300) if dry else ([131072, 900], 2, "boundary", 400),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROUTE))
def test_route(name, cpu_dry, dev, half, record):
    """Router logits against the reference (1e-4) and no decision against it wherever its margin exceeds 1e-4."""
    from elastic_vllm.ops.route.kernel import pack_router_weights, route
    from elastic_vllm.ops.route.naive import route_logits_ref
    from elastic_vllm.reference.rope import RopeSpec
    from elastic_vllm.router.model import ElasticRouter

    lens, layers, pooling, pool_tokens = ROUTE[name](sizer(cpu_dry), cpu_dry)
    hkv, d = 8, 128
    g = torch.Generator().manual_seed(4)
    kc, _vc, bt = make_paged([torch.randn(n, hkv, d, generator=g).to(dev, half) for n in lens],
                             [torch.zeros(1, hkv, d, device=dev, dtype=half) for _ in lens], 16, g)  # fmt: skip
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    spec = RopeSpec(inv.to(dev), 1.0, d, d)
    torch.manual_seed(0)
    router = ElasticRouter(layers, d).to(dev)
    rows = torch.arange(len(lens), dtype=torch.int32, device=dev)
    plens = torch.tensor(lens, dtype=torch.int32, device=dev)
    slots = torch.tensor(list(range(len(lens)))[::-1], dtype=torch.int32, device=dev) + 1
    for layer in range(layers):  # centre the decision bias so decisions mix FA and SA
        z = route_logits_ref(kc, bt, rows, plens, router, layer, spec, pooling, pool_tokens)
        router.layers[layer].cls_router_head_agnostic[4].bias.data[1] -= (z[..., 1] - z[..., 0]).median()
    w = pack_router_weights(router)
    table = torch.full((len(lens) + 2, layers, hkv), 9, dtype=torch.int8, device=dev)
    worst, wrong = 0.0, 0
    for layer in range(layers):
        lg = torch.full((len(lens), hkv, 2), float("nan"), device=dev)
        route(kc, bt, rows, plens, slots, w, layer, table, inv_freq=spec.inv_freq, logits_out=lg, pooling=pooling,
              pool_tokens=pool_tokens)  # fmt: skip
        want = route_logits_ref(kc, bt, rows, plens, router, layer, spec, pooling, pool_tokens)
        worst = max(worst, max_err(lg, want))
        margin = want[..., 1] - want[..., 0]
        sure = margin.abs() > 1e-4
        dec = torch.where(margin > 0, 0, 1).to(torch.int8)
        wrong += int((table[slots.long(), layer] != dec)[sure].sum())
    record_err(record, name, worst, 1e-4, ok=worst <= 1e-4 and wrong == 0, wrong_decisions=wrong)
