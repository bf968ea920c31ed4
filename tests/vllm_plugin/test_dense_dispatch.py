"""All-FA steps on vLLM's FlashAttention: which rows qualify (``state.row_is_dense``), that the rule is exact
(the hybrid attention of a qualifying row equals full attention, and stops doing so one token past it), and
the warm-up check that admits a dense kernel only when it computes what the elastic kernels compute.
The real kernel (vLLM's FA3 over the engine's paged cache) is checked on the GPU by the engine's own warm-up
(the admission check below, on every start) and, through the engine against FLASH_ATTN, by
tests/gpu/test_gpu_vllm.py (``-k dense``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.reference.attention import dense_paged_attention as _paged_fa
from elastic_vllm.reference.attention import hybrid_attention_ref
from elastic_vllm.reference.paged import make_paged_batch
from elastic_vllm.vllm_plugin import compat, warmup
from elastic_vllm.vllm_plugin.ops import AttnParams
from elastic_vllm.vllm_plugin.routing import decode_modes
from elastic_vllm.vllm_plugin.state import row_is_dense

FA, SSA, XA = int(HeadMode.FA), int(HeadMode.SSA), int(HeadMode.XA)
CFG = ElasticConfig(sink=4, window=32)


# (name, config, seq_len, force, decode_phase, dense)
ROWS = [
    ("prompt_within_sink_window_auto", CFG, 36, "auto", False, True),
    ("prompt_one_past_sink_window_auto", CFG, 37, "auto", False, False),
    ("prompt_past_window_all_fa", CFG, 500, "all-FA", False, True),
    ("prompt_past_window_all_sa", CFG, 500, "all-SA", False, False),
    ("prompt_within_window_all_sa", CFG, 20, "all-SA", False, True),
    ("decode_dense_past_window", CFG, 500, "auto", True, True),
    ("decode_sparse_past_window", CFG.model_copy(update={"decode_mode": "sparse"}), 500, "auto", True, False),
    ("decode_sparse_all_fa", CFG.model_copy(update={"decode_mode": "sparse"}), 500, "all-FA", True, True),
    ("fa_xa_within_window", CFG.model_copy(update={"mode": "FA-XA"}), 10, "auto", False, False),
    ("xa_ssa_all_fa", CFG.model_copy(update={"mode": "XA-SSA"}), 10, "all-FA", False, False),
]


@pytest.mark.parametrize("name,cfg,seq_len,force,decode_phase,dense", ROWS, ids=[r[0] for r in ROWS])
def test_row_is_dense(name, cfg, seq_len, force, decode_phase, dense):
    assert row_is_dense(cfg, seq_len, force, decode_phase) is dense


def _ref(batch, modes, cfg):
    return hybrid_attention_ref(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        modes, cfg.sink, cfg.window,
    )  # fmt: skip


@pytest.mark.parametrize("seq_len", [1, 17, CFG.window, CFG.sink + CFG.window])
def test_within_window_hybrid_equals_full_attention(seq_len):
    """What row_is_dense relies on: at seq_len <= sink + window every SSA head is exactly FA (chunks too)."""
    g = torch.Generator().manual_seed(seq_len)
    batch = make_paged_batch([seq_len, seq_len], [seq_len, max(1, seq_len // 3)], 4, 2, 16, generator=g)
    mixed = torch.tensor([[SSA, FA], [SSA, SSA]], dtype=torch.int8)
    torch.testing.assert_close(_ref(batch, mixed, CFG), _ref(batch, torch.zeros_like(mixed), CFG), atol=0, rtol=0)


def test_one_past_window_hybrid_differs():
    """The rule's boundary is exact: at sink + window + 1 keys an SSA head no longer sees every key."""
    g = torch.Generator().manual_seed(3)
    n = CFG.sink + CFG.window + 1
    batch = make_paged_batch([n], [n], 2, 1, 16, generator=g)
    ssa = torch.tensor([[SSA]], dtype=torch.int8)
    diff = (_ref(batch, ssa, CFG) - _ref(batch, torch.zeros_like(ssa), CFG)).abs().amax(dim=(1, 2))
    assert diff[:-1].max() == 0 and diff[-1] > 1e-3  # only the last query loses a key (key CFG.sink)


def test_dense_decode_modes_are_all_fa():
    modes = torch.tensor([[FA, SSA, XA]], dtype=torch.int8)
    assert decode_modes(modes, "dense").eq(FA).all()
    assert decode_modes(modes, "sparse").tolist() == [[FA, SSA, FA]]


# --- the warm-up's admission check ---------------------------------------------------------------------------
def _wrong_window(q, key_cache, value_cache, out, qsl, seq_lens, block_table, max_q, max_s, scale):
    """A kernel that drops keys (a sliding window of 4): what a wrong mask or layout looks like."""
    modes = torch.full((seq_lens.shape[0], key_cache.shape[2]), SSA, dtype=torch.int8)
    out.copy_(hybrid_attention_ref(q, key_cache, value_cache, block_table, qsl, seq_lens, modes, 0, 4, scale=scale))
    return out


def _raises(*a, **k):
    raise RuntimeError("page size not supported")


def _leaves_nan(q, key_cache, value_cache, out, *a):
    return out  # writes nothing: the NaN poison stays


def _fake_state():
    p = AttnParams(scale=16**-0.5, sink=4, window=32, xattn_stride=4, xattn_block=16, xattn_threshold=0.9)
    return SimpleNamespace(num_kv_heads=2, dense_attention=None, params=p)


def _check_batch():
    g = torch.Generator().manual_seed(5)
    seq, q_lens = [40, 70, 9], [1, 70, 9]
    b = make_paged_batch(seq, q_lens, 4, 2, 16, generator=g)
    return b, seq, q_lens


@pytest.mark.parametrize(
    "fn,admitted,reason",
    [
        (_paged_fa, True, ""),
        (_wrong_window, False, "disagrees"),
        (_raises, False, "failed on the paged cache"),
        (_leaves_nan, False, "disagrees"),
    ],
    ids=["correct", "wrong_mask", "raises", "unwritten_output"],
)
def test_admit_dense(monkeypatch, caplog, fn, admitted, reason):
    """Admitted only when the dense kernel matches the elastic kernels on the check batch (run here through
    Triton's interpreter); otherwise a warning names why and all-FA steps stay on the elastic kernels."""
    monkeypatch.setattr(compat, "flash_attn_dense", lambda dtype, d: (fn, "test kernel"))
    st = _fake_state()
    b, seq, q_lens = _check_batch()
    qsl = b.query_start_loc
    with caplog.at_level(logging.WARNING, logger="elastic_vllm.vllm_plugin"):
        rep = warmup._admit_dense(
            st, b.q.dtype, 16, b.q, b.key_cache, b.value_cache, b.block_table, qsl, b.seq_lens, q_lens, seq, st.params
        )
    assert (st.dense_attention is fn) is admitted
    assert (rep["dense"] == "test kernel") is admitted
    if not admitted:
        assert reason in rep["dense_reason"] and reason in caplog.text


def test_no_dense_kernel_on_cpu():
    fn, why = compat.flash_attn_dense(torch.bfloat16, 64)
    assert fn is None and why


def test_dense_env_values(monkeypatch):
    monkeypatch.setenv(warmup.DENSE_ENV, "off")
    assert warmup.dense_requested() is False
    monkeypatch.setenv(warmup.DENSE_ENV, "maybe")
    with pytest.raises(ValueError, match=warmup.DENSE_ENV):
        warmup.dense_requested()


def test_warm_up_runs_every_kernel_call(monkeypatch):
    """The warm-up's launches are well-formed (shapes, dtypes, the mixed step's offsets) and it admits a
    correct dense kernel: the whole function through Triton's interpreter on a small engine shape."""
    monkeypatch.setattr(warmup, "PROMPT_LENS", (40, 9))
    monkeypatch.setattr(warmup, "DECODE_LEN", 20)
    monkeypatch.setattr(compat, "flash_attn_dense", lambda dtype, d: (_paged_fa, "test kernel"))
    cfg = ElasticConfig(sink=4, window=16)
    p = AttnParams(scale=0.0, sink=4, window=16, xattn_stride=4, xattn_block=16, xattn_threshold=0.9)
    st = SimpleNamespace(
        device=torch.device("cpu"), block_size=16, num_kv_heads=2, cfg=cfg, params=p, router=None,
        kernel_router=None, dense_attention=None,
    )  # fmt: skip
    rep = warmup.warm_up(st, torch.float32, 4, 16)
    assert rep["dense"] == "test kernel" and st.dense_attention is _paged_fa
    assert rep["dense_rel_err"] < 1e-5  # fp32 both ways


def test_warmup_routes_both_router_variants():
    """The router compiles one variant for the fused epilogue (rows of different biases: a threshold per row) and
    one for the logits the budget glue reads (``elastic_target_omega``); the warm-up routes a batch of each, built
    as the engine builds them, so neither compiles while serving (GPU: vLLM's JIT monitor)."""
    from elastic_vllm.router.model import budget_sa_counts
    from elastic_vllm.vllm_plugin.routing import RouteRow, build_route_batch

    table = torch.arange(1, 1 + 3 * 32, dtype=torch.int32).view(3, 32)  # a decode row, then the two prompts
    batches = [
        build_route_batch(rows, table, 16, "mean", 100, budget_sa=lambda t: budget_sa_counts(t, 2, 0, 1, 2))
        for rows in warmup.router_warmup_rows(RouteRow)
    ]
    assert sorted(rb.needs_glue for rb in batches) == [False, True]  # the fused kernel and the glue's logits
    fused = next(rb for rb in batches if not rb.needs_glue)
    assert fused.uniform_bias is None  # rows of different biases: the per-row thresholds


# --- FA heads of hybrid steps on the dense kernel (ops.fa_heads_attention) --------------------------------------
def _fa3_like(calls):
    """The dense kernel's contract as FlashAttention keeps it: full causal attention of the rows that have keys
    (``seq_lens`` is the per-head key count), and for a row with 0 keys an output the caller must overwrite
    (here 1e4, so a row left as written fails the comparison). It refuses what FA3 refuses: key counts that are
    not a contiguous int32 vector (on the H100 a strided row of them raised "seqused_k must be contiguous")."""

    def fn(q, key_cache, value_cache, out, qsl, seq_lens, block_table, max_q, max_s, scale):
        if not seq_lens.is_contiguous() or seq_lens.dtype != torch.int32:
            raise RuntimeError("seqused_k must be contiguous")
        calls.append((q.shape[1], key_cache.shape[2], seq_lens.tolist()))
        ref = _paged_fa(q, key_cache, value_cache, torch.empty_like(q), qsl, seq_lens, block_table, max_q, max_s,
                        scale)  # fmt: skip
        rows = torch.repeat_interleave(seq_lens > 0, qsl.diff().long())
        out.copy_(torch.where(rows[:, None, None], ref, torch.full_like(ref, 1e4)))
        return out

    return fn


@pytest.mark.parametrize("mode", ["FA-SSA", "FA-XA"])
def test_fa_heads_split_equals_the_hybrid_kernel(mode):
    """A mixed step (a decode row, chunked and whole prompt rows) with the prompt rows' FA heads on a dense
    kernel and the rest on the hybrid prefill (``skip_fa``) equals the hybrid kernels alone, and the dense kernel
    is called once per KV head with G query heads, key counts 0 where that head is not FA. The real kernel
    (vLLM's FA3) is checked by the engine's warm-up on every start and by tests/gpu/test_gpu_kernels.py."""
    from elastic_vllm.vllm_plugin.ops import triton_attention

    g = torch.Generator().manual_seed(29)
    seq, q_lens = [60, 90, 41], [1, 30, 41]
    b = make_paged_batch(seq, q_lens, 4, 2, 16, generator=g)
    sa = SSA if mode == "FA-SSA" else XA
    modes = torch.tensor([[FA, sa], [sa, FA], [FA, FA]], dtype=torch.int32)
    p = AttnParams(scale=16**-0.5, sink=4, window=16, xattn_stride=4, xattn_block=16, xattn_threshold=0.9)
    args = (b.block_table, b.query_start_loc, b.seq_lens, modes, p)
    tail = (1, 1, max(q_lens), max(seq), mode == "FA-XA", b.query_start_loc[1:] - 1)
    ref = torch.full_like(b.q, float("nan"))
    triton_attention(b.q, b.key_cache, b.value_cache, *args, ref, *tail)
    calls = []
    got = torch.full_like(b.q, float("nan"))
    triton_attention(b.q, b.key_cache, b.value_cache, *args, got, *tail, _fa3_like(calls))
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert calls == [(2, 1, [0, 41]), (2, 1, [90, 41])]  # prompt rows only; head 0 is FA in row 2 only


def test_warm_up_admits_the_split_only_when_it_agrees(monkeypatch):
    """The warm-up admits the FA-heads split with a correct dense kernel and refuses it, naming why, with one
    that is right on whole rows (the all-FA check admits it) but rejects rows of 0 keys."""
    monkeypatch.setattr(warmup, "PROMPT_LENS", (40, 9))
    monkeypatch.setattr(warmup, "DECODE_LEN", 20)
    p = AttnParams(scale=0.0, sink=4, window=16, xattn_stride=4, xattn_block=16, xattn_threshold=0.9)

    def state(cfg):
        return SimpleNamespace(
            device=torch.device("cpu"), block_size=16, num_kv_heads=2, cfg=cfg, params=p, router=None,
            kernel_router=None, dense_attention=None, fa_heads_attention=None,
        )  # fmt: skip

    good = _fa3_like([])
    monkeypatch.setattr(compat, "flash_attn_dense", lambda dtype, d: (good, "test kernel"))
    st = state(ElasticConfig(sink=4, window=16))
    rep = warmup.warm_up(st, torch.float32, 4, 16)
    assert st.fa_heads_attention is good and rep["fa_split"] and rep["fa_split_rel_err"] < 1e-5

    def no_empty_rows(q, key_cache, value_cache, out, qsl, seq_lens, *a):  # right on whole rows only
        if not bool((seq_lens > 0).all()):
            raise RuntimeError("seqused_k must be positive")
        return _paged_fa(q, key_cache, value_cache, out, qsl, seq_lens, *a)

    monkeypatch.setattr(compat, "flash_attn_dense", lambda dtype, d: (no_empty_rows, "test kernel"))
    st = state(ElasticConfig(sink=4, window=16))
    rep = warmup.warm_up(st, torch.float32, 4, 16)
    assert st.dense_attention is no_empty_rows and st.fa_heads_attention is None
    assert "seqused_k must be positive" in rep["fa_split_reason"]

    st = state(ElasticConfig(sink=4, window=16, mode="XA-SSA"))  # no FA heads: nothing to split
    monkeypatch.setattr(compat, "flash_attn_dense", lambda dtype, d: (good, "test kernel"))
    rep = warmup.warm_up(st, torch.float32, 4, 16)
    assert st.fa_heads_attention is None and rep["fa_split"] is None


def test_dense_reference_writes_zero_for_rows_without_keys():
    g = torch.Generator().manual_seed(31)
    b = make_paged_batch([40, 20], [10, 20], 4, 2, 16, generator=g)
    out = torch.full_like(b.q, float("nan"))
    _paged_fa(b.q, b.key_cache, b.value_cache, out, b.query_start_loc, torch.tensor([40, 0], dtype=torch.int32),
              b.block_table, 20, 40, 0.25)  # fmt: skip
    assert out[10:].eq(0).all()
    whole = _paged_fa(b.q, b.key_cache, b.value_cache, torch.empty_like(b.q), b.query_start_loc, b.seq_lens,
                      b.block_table, 20, 40, 0.25)  # fmt: skip
    torch.testing.assert_close(out[:10], whole[:10], atol=0, rtol=0)
