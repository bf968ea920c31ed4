"""Attention Router on the GPU: boundary keys from the paged cache -> pre-RoPE -> pool -> MLPs -> decision.

For each routed request r (prompt of ``prompt_lens[r]`` tokens, block-table row ``req_rows[r]``)
and every KV head of ONE layer::

    y   = key_cache at the boundary positions (first / last pool_tokens, no token twice)  [P, Hkv, d]
    x   = invert_rope(y) = (y cos - rotate_half(y) sin) / attention_scaling            (fp32)
    x   = mean over the P positions                                                   [Hkv, d]
    f   = W2 silu(W1 x + b1) + b2                                    Task MLP   d -> 4d -> d
    z   = W5 silu(W4 silu(W3 f + b3) + b4) + b5                      Router MLP d -> 4d -> d -> 2
    table[slots[r], layer, h] = fa_value if z[h, 1] > z[h, 0] else sa_value     (index 1 = FA)

Everything runs in float32 (as ``ElasticRouter`` does), so decisions match the reference except
where the two logits are within float32 rounding of each other.

Work split: NC programs per request. Reading the ~1 MB of fp32 weights of a layer from one SM
takes ~8 us; split over NC programs it takes ~8/NC us. Each MLP pair (Linear d->4d, SiLU,
Linear 4d->d) is split along its hidden dimension, so program c needs only its hidden chunk and
the pair's result is the sum of the NC partial products::

    phase 0: pool a 1/NC share of the boundary tokens         -> partial sums     | barrier
    phase 1: Task MLP, hidden chunk c                         -> partial f        | barrier
    phase 2: Router MLP layers 1-2, hidden chunk c            -> partial v
             the last program to finish: v -> SiLU -> Linear(d, 2) -> argmax -> table

``fused=True`` (GPU default) runs the three phases in ONE launch; the barriers are spin-waits on
per-request counters (grid <= SM count, so all programs are resident; a spin limit turns a
would-be hang into an error flag, see ``route_errors``). ``fused=False`` runs one launch per
phase (used under the CPU interpreter, whose programs run one after another).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DTYPES, MODE_DTYPES, check_tensor, interpret, next_pow2, num_sms, prev_pow2

MAX_SPINS = 1 << 20  # ~1 s of polling before a barrier gives up and flags an error

_WS: dict = {}


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _grid_barrier(p_cnt, n, p_err, max_spins):
    """All n programs of a request arrive before any leaves (they are co-resident by construction)."""
    tl.debug_barrier()  # this program's partial results are written
    tl.atomic_add(p_cnt, 1, sem="acq_rel")
    seen = tl.atomic_add(p_cnt, 0, sem="acquire")
    spins = seen * 0
    while (seen < n) & (spins < max_spins):
        seen = tl.atomic_add(p_cnt, 0, sem="acquire")
        spins += 1
    tl.atomic_max(p_err, (seen < n).to(tl.int32))
    tl.debug_barrier()


@triton.jit(do_not_specialize=["layer", "pool_tokens", "fa_value", "sa_value"])
def _route_kernel(
    key_cache,
    block_table,
    req_rows,
    prompt_lens,
    slots,
    inv_freq,
    weights,
    table,
    logits,
    ws,  # fp32 [R, 3, NC, HKV * D]: pooled / task / router partials
    cnt,  # int32 [R, 4]: barrier 0, barrier 1, finished programs, error flag
    s_kb,
    s_kt,
    s_kh,
    s_bt,
    s_w,
    s_t0,
    s_t1,
    s_t2,
    layer,
    pool_tokens,
    attention_scaling,
    fa_value,
    sa_value,
    max_spins,
    NC: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HKV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    HID: tl.constexpr,
    CH: tl.constexpr,
    ROT: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PHASE: tl.constexpr,  # -1: all phases in one launch; 0, 1, 2: that phase only
    HAS_LOGITS: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_r = tl.program_id(1)
    HD: tl.constexpr = HKV * D
    # packed per-layer weights (see pack_router_weights)
    OFF_W1: tl.constexpr = 0
    OFF_B1: tl.constexpr = OFF_W1 + HID * D
    OFF_W2: tl.constexpr = OFF_B1 + HID
    OFF_B2: tl.constexpr = OFF_W2 + D * HID
    OFF_W3: tl.constexpr = OFF_B2 + D
    OFF_B3: tl.constexpr = OFF_W3 + HID * D
    OFF_W4: tl.constexpr = OFF_B3 + HID
    OFF_B4: tl.constexpr = OFF_W4 + D * HID
    OFF_W5: tl.constexpr = OFF_B4 + D
    OFF_B5: tl.constexpr = OFF_W5 + 2 * D
    p_w = weights + layer * s_w
    p_ws = ws + i_r.to(tl.int64) * (3 * NC * HD)
    p_cnt = cnt + i_r * 4

    n_len = tl.load(prompt_lens + i_r)
    n_pool = tl.minimum(n_len, 2 * pool_tokens)  # pooled positions: k < pool_tokens ? k : k + shift
    shift = n_len - n_pool

    if PHASE <= 0:
        # ---- phase 0: gather + un-RoPE + sum a 1/NC share of the boundary tokens
        i_req = tl.load(req_rows + i_r).to(tl.int64)
        p_bt = block_table + i_req * s_bt
        per = tl.cdiv(n_pool, NC)
        k_lo = i_c * per
        k_hi = tl.minimum(k_lo + per, n_pool)
        o_hd = tl.arange(0, BLOCK_HD)
        o_h = o_hd // D
        o_d = o_hd % D
        m_hd = o_hd < HD
        HALF: tl.constexpr = ROT // 2
        is_rot = o_d < ROT
        first = o_d < HALF
        o_pd = tl.where(first, o_d + HALF, o_d - HALF)  # rotate_half partner
        sign = tl.where(first, 1.0, -1.0)
        freq = tl.load(inv_freq + o_d % HALF, mask=is_rot & m_hd, other=0.0)  # [BHD]
        o_col = o_h.to(tl.int64) * s_kh + o_d
        o_pcol = o_h.to(tl.int64) * s_kh + o_pd
        b_sum = tl.zeros([BLOCK_HD], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_T):
            o_k = k0 + tl.arange(0, BLOCK_T)
            m_k = o_k < k_hi
            pos = tl.where(o_k < pool_tokens, o_k, o_k + shift)  # [BT]
            i_blk = tl.load(p_bt + pos // BS, mask=m_k, other=0).to(tl.int64)
            o_row = i_blk * s_kb + (pos % BS).to(tl.int64) * s_kt  # [BT]
            m_2 = m_k[:, None] & m_hd[None, :]
            b_y = tl.load(key_cache + o_row[:, None] + o_col[None, :], mask=m_2, other=0.0).to(tl.float32)
            b_yp = tl.load(key_cache + o_row[:, None] + o_pcol[None, :], mask=m_2 & is_rot[None, :], other=0.0).to(
                tl.float32
            )
            ang = pos.to(tl.float32)[:, None] * freq[None, :]  # [BT, BHD], as RopeSpec.cos_sin
            b_x = (b_y * tl.cos(ang) + sign[None, :] * b_yp * tl.sin(ang)) / attention_scaling
            b_x = tl.where(is_rot[None, :], b_x, b_y)
            b_sum += tl.sum(tl.where(m_k[:, None], b_x, 0.0), 0)
        tl.store(p_ws + i_c * HD + o_hd, b_sum, mask=m_hd)
        if PHASE == -1:
            _grid_barrier(p_cnt, NC, p_cnt + 3, max_spins)

    o_hh = tl.arange(0, BLOCK_H)
    o_dd = tl.arange(0, BLOCK_D)
    o_j = i_c * CH + tl.arange(0, CH)  # this program's hidden units
    m_h = o_hh < HKV
    m_dd = o_dd < D
    m_hdd = m_h[:, None] & m_dd[None, :]
    o_hdd = o_hh[:, None] * D + o_dd[None, :]  # [BH, BD] into a [HKV, D] slab

    if (PHASE == -1) | (PHASE == 1):
        # ---- phase 1: pooled mean -> Task MLP hidden chunk -> partial f
        b_x = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for i_p in range(NC):
            b_x += tl.load(p_ws + i_p * HD + o_hdd, mask=m_hdd, other=0.0, cache_modifier=".cg")
        b_x = b_x / n_pool.to(tl.float32)
        b_w1 = tl.load(p_w + OFF_W1 + o_j[:, None] * D + o_dd[None, :], mask=m_dd[None, :], other=0.0)  # [CH, BD]
        b_b1 = tl.load(p_w + OFF_B1 + o_j)  # [CH]
        b_hid = _silu(tl.dot(b_x, tl.trans(b_w1), input_precision="ieee") + b_b1[None, :])  # [BH, CH]
        b_w2 = tl.load(p_w + OFF_W2 + o_dd[:, None] * HID + o_j[None, :], mask=m_dd[:, None], other=0.0)  # [BD, CH]
        b_f = tl.dot(b_hid, tl.trans(b_w2), input_precision="ieee")  # [BH, BD]
        tl.store(p_ws + (NC + i_c) * HD + o_hdd, b_f, mask=m_hdd)
        if PHASE == -1:
            _grid_barrier(p_cnt + 1, NC, p_cnt + 3, max_spins)

    if (PHASE == -1) | (PHASE == 2):
        # ---- phase 2: f -> Router MLP layers 1-2 hidden chunk -> partial v
        b_f = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for i_p in range(NC):
            b_f += tl.load(p_ws + (NC + i_p) * HD + o_hdd, mask=m_hdd, other=0.0, cache_modifier=".cg")
        b_f += tl.load(p_w + OFF_B2 + o_dd, mask=m_dd, other=0.0)[None, :]
        b_w3 = tl.load(p_w + OFF_W3 + o_j[:, None] * D + o_dd[None, :], mask=m_dd[None, :], other=0.0)  # [CH, BD]
        b_b3 = tl.load(p_w + OFF_B3 + o_j)
        b_u = _silu(tl.dot(b_f, tl.trans(b_w3), input_precision="ieee") + b_b3[None, :])  # [BH, CH]
        b_w4 = tl.load(p_w + OFF_W4 + o_dd[:, None] * HID + o_j[None, :], mask=m_dd[:, None], other=0.0)  # [BD, CH]
        b_v = tl.dot(b_u, tl.trans(b_w4), input_precision="ieee")  # [BH, BD]
        tl.store(p_ws + (2 * NC + i_c) * HD + o_hdd, b_v, mask=m_hdd)
        tl.debug_barrier()
        done = tl.atomic_add(p_cnt + 2, 1, sem="acq_rel")
        if done == NC - 1:
            # ---- the last program of the request: v -> SiLU -> Linear(d, 2) -> decision
            b_v = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            for i_p in range(NC):
                b_v += tl.load(p_ws + (2 * NC + i_p) * HD + o_hdd, mask=m_hdd, other=0.0, cache_modifier=".cg")
            b_v = _silu(b_v + tl.load(p_w + OFF_B4 + o_dd, mask=m_dd, other=0.0)[None, :])
            b_w50 = tl.load(p_w + OFF_W5 + o_dd, mask=m_dd, other=0.0)
            b_w51 = tl.load(p_w + OFF_W5 + D + o_dd, mask=m_dd, other=0.0)
            z0 = tl.sum(b_v * b_w50[None, :], 1) + tl.load(p_w + OFF_B5)  # [BH]
            z1 = tl.sum(b_v * b_w51[None, :], 1) + tl.load(p_w + OFF_B5 + 1)
            dec = tl.where(z1 > z0, fa_value, sa_value)  # ties -> SA, as torch.argmax
            i_slot = tl.load(slots + i_r).to(tl.int64)
            p_t = table + i_slot * s_t0 + layer * s_t1 + o_hh * s_t2
            tl.store(p_t, dec.to(table.dtype.element_ty), mask=m_h)
            if HAS_LOGITS:
                tl.store(logits + i_r * (HKV * 2) + o_hh * 2, z0, mask=m_h)
                tl.store(logits + i_r * (HKV * 2) + o_hh * 2 + 1, z1, mask=m_h)
            # every program of this request has passed both barriers: re-arm the counters
            tl.atomic_xchg(p_cnt, 0)
            tl.atomic_xchg(p_cnt + 1, 0)
            tl.atomic_xchg(p_cnt + 2, 0)


def router_param_count(head_dim: int, hidden: int) -> int:
    """Floats per layer in the packed layout: W1 b1 W2 b2 (Task MLP), W3 b3 W4 b4 W5 b5 (Router MLP)."""
    return 4 * hidden * head_dim + 2 * hidden + 4 * head_dim + 2


def pack_router_weights(router) -> torch.Tensor:
    """[L, P] float32 contiguous: each row the layer's weights in nn.Linear order
    (W1 [4d, d], b1, W2 [d, 4d], b2, W3 [4d, d], b3, W4 [d, 4d], b4, W5 [2, d], b5).

    ``router`` is an ``ElasticRouter`` (anything with ``.layers[i].cls_feat_extractor`` and
    ``.cls_router_head_agnostic`` Sequentials). Pack once at load time, not per step.
    """
    rows = []
    for lr in router.layers:
        t, r = lr.cls_feat_extractor, lr.cls_router_head_agnostic
        parts = [t[0].weight, t[0].bias, t[2].weight, t[2].bias]
        parts += [r[0].weight, r[0].bias, r[2].weight, r[2].bias, r[4].weight, r[4].bias]
        rows.append(torch.cat([p.detach().float().reshape(-1) for p in parts]))
    return torch.stack(rows).contiguous()


def _workspace(device: torch.device, R: int, nc: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached per device: counters must start at zero and are re-armed by the kernel itself."""
    ws, cnt = _WS.get(device, (None, None))
    need = R * 3 * nc * hd
    if ws is None or ws.numel() < need or cnt.shape[0] < R:
        ws = torch.empty(max(need, 1), device=device, dtype=torch.float32)
        cnt = torch.zeros(max(R, 8), 4, device=device, dtype=torch.int32)
        _WS[device] = (ws, cnt)
    return ws, cnt


def route_errors(device: torch.device) -> int:
    """Barrier timeouts seen by the fused router on ``device`` (host sync: for checks only)."""
    ws_cnt = _WS.get(device)
    return 0 if ws_cnt is None else int(ws_cnt[1][:, 3].max().item())


class Router:
    """Prepared router launcher for the hot path: validate and precompute once, launch per layer.

    ``Router(weights, table, inv_freq=..., ...)`` checks the static inputs (packed weights, decision
    table, RoPE frequencies) and fixes the launch metadata; each ``router(key_cache, block_table,
    req_rows, prompt_lens, slots, layer)`` then only reads strides and launches one kernel (fused)
    with no validation, allocation or host sync. ``route()`` is the checked one-shot equivalent.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        table: torch.Tensor,
        *,
        inv_freq: torch.Tensor,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        attention_scaling: float = 1.0,
        pool_tokens: int = 100,
        pooling: str = "boundary",
        fa_value: int = 0,
        sa_value: int = 1,
        num_chunks: int | None = None,
        fused: bool | None = None,
    ):
        dev = weights.device
        d, hkv = head_dim, num_kv_heads
        check_tensor(weights, "weights", dim=2, dtypes=(torch.float32,))
        if not weights.is_contiguous():
            raise ValueError("weights: must be contiguous (use pack_router_weights)")
        num_layers, p = weights.shape
        hidden, rem = divmod(p - 4 * d - 2, 4 * d + 2)
        if rem or hidden < 16 or hidden & (hidden - 1):
            raise ValueError(f"weights: {p} floats per layer is not a packed router for head_dim {d}")
        check_tensor(table, "table", dim=3, dtypes=MODE_DTYPES, shape=(None, num_layers, hkv), device=dev)
        check_tensor(inv_freq, "inv_freq", dim=1, dtypes=(torch.float32,), device=dev)
        rot = 2 * inv_freq.shape[0]
        if rot == 0 or rot > d:
            raise ValueError(f"inv_freq: rotary_dim {rot} must be in (0, head_dim {d}]")
        if pooling not in ("boundary", "whole"):
            raise ValueError(f"pooling: expected 'boundary' or 'whole', got {pooling!r}")
        if pool_tokens < 1:
            raise ValueError(f"pool_tokens: must be >= 1, got {pool_tokens}")
        self.fused = (not interpret()) if fused is None else fused
        if num_chunks is not None and (num_chunks < 1 or num_chunks & (num_chunks - 1) or hidden // num_chunks < 16):
            raise ValueError(f"num_chunks: a power of two with hidden/num_chunks >= 16 required, got {num_chunks}")
        if self.fused and num_chunks is not None and num_chunks > 1 and interpret():
            raise ValueError("fused: the interpreter runs programs one by one; use fused=False or num_chunks=1")
        self.device, self.num_layers, self.hidden, self.hd = dev, num_layers, hidden, hkv * d
        self.num_chunks, self.sms = num_chunks, num_sms(dev)
        self.weights, self.table, self.inv_freq = weights, table, inv_freq
        n = min(pool_tokens, 1 << 29) if pooling == "boundary" else 1 << 29  # 2n must fit in int32
        self.strides = (weights.stride(0), table.stride(0), table.stride(1), table.stride(2))
        self.tail = (n, float(attention_scaling), int(fa_value), int(sa_value), MAX_SPINS)
        self.meta = dict(
            D=d, BLOCK_D=max(16, next_pow2(d)), HKV=hkv, BLOCK_H=max(16, next_pow2(hkv)),
            BLOCK_HD=next_pow2(self.hd), HID=hidden, ROT=rot, BS=block_size,
            BLOCK_T=max(1, min(32, 8192 // next_pow2(self.hd))), num_warps=4,
        )  # fmt: skip
        self._plans: dict[int, tuple] = {}

    def plan(self, R: int) -> tuple:
        """(num_chunks, workspace, counters, launch metadata) for R routed requests, cached per R."""
        p = self._plans.get(R)
        if p is None:
            nc = self.num_chunks
            if nc is None:
                # fused: as many chunks as keep every program resident; phased (interpreter): a few
                nc = (
                    min(16, self.hidden // 16, prev_pow2(max(self.sms // R, 1)))
                    if self.fused
                    else min(4, self.hidden // 16)
                )
            if self.fused and nc > 1 and nc * R > self.sms:
                raise ValueError(
                    f"num_chunks: {nc} x {R} requests exceeds {self.sms} SMs (fused programs must be co-resident)"
                )
            ws, cnt = _workspace(self.device, R, nc, self.hd)
            phases = (-1,) if self.fused else (0, 1, 2)
            metas = [dict(self.meta, NC=nc, CH=self.hidden // nc, PHASE=ph) for ph in phases]
            p = self._plans[R] = (nc, ws, cnt, metas)
        return p

    def __call__(
        self,
        key_cache: torch.Tensor,
        block_table: torch.Tensor,
        req_rows: torch.Tensor,
        prompt_lens: torch.Tensor,
        slots: torch.Tensor,
        layer: int,
        logits_out: torch.Tensor | None = None,
    ) -> None:
        R = req_rows.shape[0]
        if R == 0:
            return
        nc, ws, cnt, metas = self.plan(R)
        ks = key_cache.stride()
        has_lg = logits_out is not None
        args = (
            key_cache, block_table, req_rows, prompt_lens, slots, self.inv_freq, self.weights, self.table,
            logits_out if has_lg else ws, ws, cnt, ks[0], ks[1], ks[2], block_table.stride(0), *self.strides,
            layer, *self.tail,
        )  # fmt: skip
        for meta in metas:
            _route_kernel[(nc, R)](*args, HAS_LOGITS=has_lg, **meta)


def route(
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    prompt_lens: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    *,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    pool_tokens: int = 100,
    pooling: str = "boundary",
    fa_value: int = 0,
    sa_value: int = 1,
    logits_out: torch.Tensor | None = None,
    num_chunks: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Route ``R`` requests at one layer and write their decisions into ``table`` in place.

    Args:
        key_cache: [num_blocks, block_size, Hkv, d] POST-RoPE keys of this layer (any strides).
        block_table: [B, max_blocks] int32; req_rows [R] int32 picks each routed request's row.
        prompt_lens: [R] int32 prompt length of each routed request (its prompt is in the cache).
        slots: [R] int32 row of ``table`` for each request.
        weights: [L, P] float32 from ``pack_router_weights``.
        layer: the layer index (Python int), used for the weights row and the table column.
        table: [slots, L, Hkv] int (HeadMode per request, layer, KV head), written at
            table[slots[r], layer, :] = fa_value (router index 1 wins) or sa_value.
        inv_freq: [rotary_dim / 2] float32, the model's RoPE frequencies (``RopeSpec.inv_freq``);
            attention_scaling: RoPE's magnitude scaling (``RopeSpec.attention_scaling``).
        pool_tokens, pooling: "boundary" = mean of the first/last pool_tokens; "whole" = all.
        logits_out: optional [R, Hkv, 2] float32, receives the router logits.
        num_chunks, fused: work split override (see module docstring).

    Returns:
        table. No host synchronisation.
    """
    check_tensor(key_cache, "key_cache", dim=4, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    dev = key_cache.device
    _nb, bs, hkv, d = key_cache.shape
    if key_cache.stride(-1) != 1:
        raise ValueError(f"key_cache: last dimension must be contiguous, got strides {key_cache.stride()}")
    check_tensor(block_table, "block_table", dim=2, dtypes=INDEX_DTYPES, device=dev)
    R = req_rows.shape[0] if isinstance(req_rows, torch.Tensor) else -1
    check_tensor(req_rows, "req_rows", dim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor(prompt_lens, "prompt_lens", dim=1, dtypes=INDEX_DTYPES, shape=(R,), device=dev)
    check_tensor(slots, "slots", dim=1, dtypes=INDEX_DTYPES, shape=(R,), device=dev)
    check_tensor(weights, "weights", dim=2, dtypes=(torch.float32,), device=dev)
    num_layers = weights.shape[0]
    router = Router(
        weights, table, inv_freq=inv_freq, num_kv_heads=hkv, head_dim=d, block_size=bs,
        attention_scaling=attention_scaling, pool_tokens=pool_tokens, pooling=pooling, fa_value=fa_value,
        sa_value=sa_value, num_chunks=num_chunks, fused=fused,
    )  # fmt: skip
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer: {layer} out of range for {num_layers} router layers")
    if logits_out is not None:
        check_tensor(logits_out, "logits_out", dtypes=(torch.float32,), shape=(R, hkv, 2), device=dev)
        if not logits_out.is_contiguous():
            raise ValueError("logits_out: must be contiguous")
    router(key_cache, block_table, req_rows, prompt_lens, slots, layer, logits_out)
    return table
