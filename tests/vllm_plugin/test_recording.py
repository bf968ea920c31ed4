"""recording.Recorder: a final routing is snapshotted at the step end and recorded when the step's output
is read (never by a later step's output hook before its own), once per request, in step order."""

from __future__ import annotations

import torch

from elastic_vllm.config import ElasticConfig
from elastic_vllm.vllm_plugin import observe
from elastic_vllm.vllm_plugin.parallel import Topology
from elastic_vllm.vllm_plugin.recording import Recorder, StepTimer
from elastic_vllm.vllm_plugin.requests import RequestState

L, H, SLOTS = 3, 4, 5


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    fa = torch.rand(SLOTS, L, H, generator=g) > 0.5
    modes = torch.where(fa, 0, 1).to(torch.int8)
    logits = torch.randn(SLOTS, L, H, 2, generator=g)
    return fa, modes, logits, None


def _state(rid: str, slot: int) -> RequestState:
    return RequestState(req_id=rid, prompt_len=64, override="auto", force="auto", table_slot=slot)


def _recorder(tp_size: int = 1) -> Recorder:
    topo = Topology(tp_rank=0, tp_size=tp_size, pp_rank=0, pp_size=1, layers=(0, L))
    return Recorder(ElasticConfig(), "m", topo, tuple(range(H)), True, None)


def test_snapshot_is_recorded_when_its_step_output_is_read():
    observe.clear()
    rec = _recorder()
    tables = _tables(0)
    rec.snapshot([_state("a", 1), _state("b", 3)], tables, StepTimer(torch.device("cpu")), step=1)
    assert observe.events() == []  # the step end only snapshots
    tables[0][1] = ~tables[0][1]  # the table slot is reused after the snapshot: the record keeps the step's rows
    rec.snapshot([_state("c", 2)], tables, StepTimer(torch.device("cpu")), step=2)
    rec.drain(upto=1)  # step 1's output: step 2's forward may still run, its snapshot waits
    assert [e.req_id for e in observe.events()] == ["a", "b"]
    want = _tables(0)[0]
    assert torch.equal(observe.events("a")[0].decisions, want[1])
    assert torch.equal(observe.events("b")[0].decisions, want[3])
    assert observe.events("a")[0].omega_msr == float((~want[1]).float().mean())
    rec.drain(upto=2)
    assert [e.req_id for e in observe.events()] == ["a", "b", "c"]
    assert torch.equal(observe.events("c")[0].decisions, tables[0][2])
    rec.drain()  # nothing left: no second record of any request
    assert len(observe.events()) == 3


def test_reroute_after_preemption_is_compared_not_recorded_again():
    observe.clear()
    rec = _recorder()
    st = _state("a", 1)
    tables = _tables(1)
    rec.snapshot([st], tables, StepTimer(torch.device("cpu")), step=1)
    before = observe.COUNTERS.snapshot()
    tables[0][1] = ~tables[0][1]
    rec.snapshot([st], tables, StepTimer(torch.device("cpu")), step=5)  # re-routed, differently
    rec.drain()
    after = observe.COUNTERS.snapshot()
    assert [e.req_id for e in observe.events()] == ["a"]
    assert after["rerouted"] - before["rerouted"] == 1
    assert after["reroute_mismatches"] - before["reroute_mismatches"] == 1


def test_tensor_parallel_records_at_the_step_end(monkeypatch):
    """The ranks' exchange runs in step order on the step's thread: no snapshot waits for an output hook."""
    from elastic_vllm.vllm_plugin import compat

    gathered = []

    def fake_gather(obj):  # the other rank holds the other half of the heads, all FA
        gathered.append(obj)
        other = [{rid: type(c)((9,), c.heads, c.heads, 0.0) for rid, c in stage.items()} for stage in obj]
        return [obj, other]

    monkeypatch.setattr(compat, "tp_all_gather_object", fake_gather)
    observe.clear()
    rec = _recorder(tp_size=2)
    tables = _tables(2)
    rec.snapshot([_state("a", 1)], tables, StepTimer(torch.device("cpu")), step=1)
    ev = observe.events("a")
    assert len(ev) == 1 and len(gathered) == 1
    sa = int((~tables[0][1]).sum())
    assert ev[0].omega_msr_all == sa / (2 * L * H)  # the other rank's heads count, all FA
