"""benchmarks/query_guard.py: the per-query signals against a plain per-query loop, and the guard's head rule."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("query_guard", ROOT / "benchmarks" / "query_guard.py")
qg = importlib.util.module_from_spec(spec)
sys.modules["query_guard"] = qg  # its dataclasses look their module up
spec.loader.exec_module(qg)


def loop_signals(q, k, v, scale):
    """One query head, one query at a time, float64, the SA pattern written out."""
    Hq, T = q.shape[1], q.shape[2]
    G = Hq // k.shape[1]
    nq = min(qg.NQ_MAX, T)
    far = torch.zeros(Hq, nq, dtype=torch.float64)
    out = torch.zeros(Hq, nq, dtype=torch.float64)
    peak = torch.zeros(Hq, nq, dtype=torch.float64)
    for h in range(Hq):
        kk, vv = k[0, h // G].double(), v[0, h // G].double()
        for n, i in enumerate(range(T - nq, T)):
            s = (kk[: i + 1] @ q[0, h, i].double()) * scale
            p = torch.softmax(s, 0)
            sa = torch.tensor([j < qg.SINK or i - j < qg.WINDOW for j in range(i + 1)])
            p_sa = torch.softmax(s.masked_fill(~sa, float("-inf")), 0)
            o_fa, o_sa = p @ vv[: i + 1], p_sa @ vv[: i + 1]
            far[h, n] = p[~sa].sum()
            out[h, n] = (o_fa - o_sa).norm() / o_fa.norm()
            peak[h, n] = p[~sa].max() if bool((~sa).any()) else 0.0
            # the identity a kernel would use: far mass = 1 - exp(lse_SA - lse_FA)
            lse_fa, lse_sa = torch.logsumexp(s, 0), torch.logsumexp(s[sa], 0)
            assert abs(float(far[h, n]) - (1 - float(torch.exp(lse_sa - lse_fa)))) < 1e-9
    return {"far": far, "out": out, "peak": peak}


@pytest.mark.parametrize("T", [700, 1100])
def test_signals_match_the_per_query_loop(T):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, 6, T, 16, generator=g) * 2  # * 2: peaked rows, so the max over far keys is not flat
    k = torch.randn(1, 2, T, 16, generator=g)
    v = torch.randn(1, 2, T, 16, generator=g)
    got, p_last = qg.per_query_signals(q, k, v, 0.25)
    want = loop_signals(q, k, v, 0.25)
    for name in ("far", "out", "peak"):
        assert got[name].shape == (6, qg.NQ_MAX)
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-5, msg=name)
    assert bool((want["far"] > 0.01).any()), "the keys past sink + window must carry some mass in this test"
    torch.testing.assert_close(p_last.sum(-1), torch.ones(6))


def test_inside_the_window_nothing_is_far():
    q, k, v = torch.randn(1, 4, 500, 8), torch.randn(1, 2, 500, 8), torch.randn(1, 2, 500, 8)
    got, _ = qg.per_query_signals(q, k, v, 0.3)
    assert float(got["far"].abs().max()) == 0.0 and float(got["out"].abs().max()) < 1e-6


def test_head_signal_reduces_each_kv_group_and_the_last_n_q_queries(monkeypatch):
    monkeypatch.setattr(qg, "HKV", 2)
    x = torch.zeros(4, qg.NQ_MAX)  # query heads 0, 1 -> KV head 0; 2, 3 -> KV head 1
    x[1, -1] = 0.8  # the last query of query head 1
    x[2, 0] = 0.9  # the first of the NQ_MAX queries: outside the last 16
    raw = {"far": x, "out": x, "peak": x}
    torch.testing.assert_close(qg.head_signal(raw, "far_max", 16), torch.tensor([0.8, 0.0]))
    torch.testing.assert_close(qg.head_signal(raw, "far_max", qg.NQ_MAX), torch.tensor([0.8, 0.9]))
    torch.testing.assert_close(qg.head_signal(raw, "far_mean", 16), torch.tensor([0.8 / 32, 0.0]))


def test_guard_only_adds_fa_heads(monkeypatch):
    monkeypatch.setattr(qg, "HKV", 2)
    sig = torch.tensor([[0.1, 0.6], [0.7, 0.2]])  # [L, Hkv] peak_max of two layers
    raw = {layer: {"peak": sig[layer].repeat_interleave(2)[:, None].expand(4, qg.NQ_MAX)} for layer in range(2)}
    routing = torch.tensor([[True, False], [False, False]])
    res = {"signals": raw, "routing": routing}
    torch.testing.assert_close(qg.guarded(res, "peak_max", 64, 0.5), torch.tensor([[True, True], [True, False]]))
    torch.testing.assert_close(qg.guarded(res, "peak_max", 64, 0.9), routing)


def test_switch_fires_at_the_first_layer_where_a_router_sa_head_peaks(monkeypatch):
    monkeypatch.setattr(qg, "HKV", 2)
    sig = torch.tensor([[0.95, 0.1], [0.2, 0.3], [0.1, 0.92]])  # [L, Hkv]
    raw = {layer: {"peak": sig[layer].repeat_interleave(2)[:, None].expand(4, qg.NQ_MAX)} for layer in range(3)}
    routing = torch.tensor([[True, False], [False, False], [False, False]])  # layer 0's peaked head is FA already
    res = {"signals": raw, "routing": routing}
    assert qg.switch_layer(res, "peak_max", 64, 0.9) == 2
    assert qg.switch_layer(res, "peak_max", 64, 0.25) == 1
    assert qg.switch_layer(res, "peak_max", 64, 0.99) is None
