import pytest
import torch

from elastic_vllm.config import ElasticConfig, HeadMode
from elastic_vllm.sparsity import causal_pairs, head_esr, omega_esr, omega_msr, ssa_visible_pairs, xa_visible_pairs


def brute_ssa(L, sink, window):
    return sum(1 for i in range(L) for j in range(i + 1) if j < sink or i - j < window)


def test_known_case():
    # L=4, sink 1, window 2: rows see 1, 2, 3, 3 keys = 9 of 10 causal pairs
    assert ssa_visible_pairs(4, 1, 2) == 9
    assert head_esr(HeadMode.SSA, 4, 1, 2) == pytest.approx(0.1)
    assert head_esr(HeadMode.FA, 4, 1, 2) == 0.0


@pytest.mark.parametrize("L", [1, 2, 7, 33, 100])
@pytest.mark.parametrize("sink,window", [(0, 1), (1, 2), (4, 8), (16, 4), (0, 200), (200, 1)])
def test_ssa_closed_form(L, sink, window):
    assert ssa_visible_pairs(L, sink, window) == brute_ssa(L, sink, window)


def test_xa_pairs_brute_force():
    L, blk = 70, 16
    nb = 5
    bm = torch.rand(nb, nb) < 0.5
    want = sum(1 for i in range(L) for j in range(i + 1) if bm[i // blk, j // blk])
    assert xa_visible_pairs(bm, L, blk) == want


def test_paper_scale_numbers():
    # 128K tokens, sink 128 + window 2048: an SSA head skips ~96.8% of the causal pairs
    L = 131072
    esr = head_esr(HeadMode.SSA, L, 128, 2048)
    assert esr == pytest.approx(1 - (ssa_visible_pairs(L, 128, 2048) / causal_pairs(L)))
    assert 0.96 < esr < 0.975


def test_omegas_per_request():
    is_fa = torch.tensor([[True, False, False], [False, False, True]])
    assert omega_msr(is_fa) == pytest.approx(4 / 6)
    cfg = ElasticConfig(sink=1, window=2)
    modes = torch.where(is_fa, int(HeadMode.FA), int(HeadMode.SSA))
    assert omega_esr(modes, 4, cfg) == pytest.approx(4 / 6 * 0.1)
    with pytest.raises(ValueError):
        omega_msr(torch.zeros(0, dtype=torch.bool))
