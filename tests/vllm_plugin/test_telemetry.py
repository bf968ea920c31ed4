import os
import subprocess
import sys

import pytest
import torch
from prometheus_client import REGISTRY

from elastic_vllm.supervisor import OWNER_FILE, PREFIX, prepare_multiproc_dir, vllm_serve_argv
from elastic_vllm.telemetry.metrics import RoutingRecord, record_routing


def _val(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_record_routing_counts_every_head_once():
    dec = torch.tensor([[True, False, False], [False, False, False]])
    before_sa0 = _val("elastic:head_decisions_total", model_name="t", layer="0", decision="SA", tp_rank="0")
    before_fa0 = _val("elastic:head_decisions_total", model_name="t", layer="0", decision="FA", tp_rank="0")
    before_sa1 = _val("elastic:head_decisions_total", model_name="t", layer="1", decision="SA", tp_rank="0")
    before_n = _val("elastic:request_omega_msr_count", model_name="t")
    before_sum = _val("elastic:request_omega_msr_sum", model_name="t")
    before_req = _val("elastic:requests_total", model_name="t", override="all-SA")
    rec = RoutingRecord("r1", "t", dec, omega_msr=5 / 6, omega_esr=0.4, prompt_len=100, router_latency_s=1e-4)
    rec.override = "all-SA"
    record_routing(rec)
    assert _val("elastic:head_decisions_total", model_name="t", layer="0", decision="SA", tp_rank="0") == before_sa0 + 2
    assert _val("elastic:head_decisions_total", model_name="t", layer="0", decision="FA", tp_rank="0") == before_fa0 + 1
    assert _val("elastic:head_decisions_total", model_name="t", layer="1", decision="SA", tp_rank="0") == before_sa1 + 3
    assert _val("elastic:request_omega_msr_count", model_name="t") == before_n + 1
    assert _val("elastic:request_omega_msr_sum", model_name="t") == pytest.approx(before_sum + 5 / 6)
    assert _val("elastic:requests_total", model_name="t", override="all-SA") == before_req + 1


def test_nonzero_rank_records_counters_not_request_histograms():
    before = _val("elastic:request_omega_msr_count", model_name="tp")
    record_routing(RoutingRecord("r", "tp", torch.ones(1, 2, dtype=torch.bool), 0.0, 0.0, 10, 1e-4, tp_rank=1))
    assert _val("elastic:request_omega_msr_count", model_name="tp") == before
    assert _val("elastic:head_decisions_total", model_name="tp", layer="0", decision="FA", tp_rank="1") >= 2


def test_replica_rank_does_not_count_heads_again():
    """tp_size > num_kv_heads: a rank replicating heads another rank counts records its latency only."""
    labels = dict(model_name="rep", layer="0", decision="SA", tp_rank="1")
    before = _val("elastic:head_decisions_total", **labels)
    rec = RoutingRecord("r", "rep", torch.zeros(1, 2, dtype=torch.bool), 1.0, 0.5, 10, 1e-4, tp_rank=1)
    rec.count_heads = False
    record_routing(rec)
    assert _val("elastic:head_decisions_total", **labels) == before
    assert _val("elastic:router_latency_seconds_count", model_name="rep", tp_rank="1") >= 1


def test_multiproc_dir_is_fresh_and_stale_ones_go(tmp_path):
    stale = tmp_path / f"{PREFIX}abcdefgh"
    stale.mkdir()
    (stale / "counter_1.db").write_bytes(b"x")
    (stale / OWNER_FILE).write_text("999999999")  # a wrapper that is gone
    foreign = tmp_path / f"{PREFIX}notours"  # no owner file: left alone
    foreign.mkdir()
    d = prepare_multiproc_dir(str(tmp_path))
    assert d.name.startswith(PREFIX) and str(os.getpid()) not in d.name  # mkdtemp: not predictable
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in d.iterdir()] == [OWNER_FILE] and (d / OWNER_FILE).read_text() == str(os.getpid())
    assert not stale.exists() and foreign.exists()
    assert prepare_multiproc_dir(str(tmp_path)) != d and d.exists()  # a live run's folder stays


def test_serve_argv_adds_elastic_unless_another_backend():
    assert vllm_serve_argv("m", ["--port", "1"])[-2:] == ["--attention-backend", "elastic"]
    argv = vllm_serve_argv("m", ["--attention-backend=TRITON_ATTN"])
    assert argv.count("--attention-backend") == 0 and argv[-1] == "--attention-backend=TRITON_ATTN"
    # this interpreter's vLLM, not whichever `vllm` script is first on PATH (or none: a PYTHONPATH install)
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m"]
    r = subprocess.run([*argv[:3], "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "serve" in r.stdout, r.stderr[-2000:]


def test_earlier_pipeline_stage_counts_its_layers_only():
    """A stage holding layers 2-3 labels its decisions with the global layer index; a stage other than the last
    records neither the request (its Omegas are assembled on the last stage) nor the router time."""
    labels = dict(model_name="pp", decision="SA", tp_rank="0")
    before = {layer: _val("elastic:head_decisions_total", layer=str(layer), **labels) for layer in range(4)}
    rec = RoutingRecord("r", "pp", torch.zeros(2, 2, dtype=torch.bool), float("nan"), float("nan"), 10, 1e-4)
    rec.first_layer, rec.pp_last = 2, False
    record_routing(rec)
    got = {
        layer: _val("elastic:head_decisions_total", layer=str(layer), **labels) - before[layer] for layer in range(4)
    }
    assert got == {0: 0, 1: 0, 2: 2, 3: 2}
    assert _val("elastic:request_omega_msr_count", model_name="pp") == 0
    assert _val("elastic:router_latency_seconds_count", model_name="pp", tp_rank="0") == 0
    assert _val("elastic:requests_total", model_name="pp", override="auto") == 0


def test_metrics_exporter_serves_what_another_process_wrote(tmp_path):
    """A worker process (here a child with PROMETHEUS_MULTIPROC_DIR) records a routing; the exporter of that
    node serves it over HTTP."""
    import subprocess
    import sys
    import urllib.request

    from elastic_vllm.telemetry.exporter import start_exporter

    script = (
        "import torch\nfrom elastic_vllm.telemetry.metrics import RoutingRecord, record_routing\n"
        "record_routing(RoutingRecord('r', 'node2', torch.zeros(3, 2, dtype=torch.bool), 1.0, 0.5, 10, 1e-4))\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    server = start_exporter(tmp_path, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        server.shutdown()
    assert 'elastic:request_omega_msr_count{model_name="node2"} 1.0' in text
    assert 'elastic:head_decisions_total{decision="SA",layer="2",model_name="node2",tp_rank="0"} 2.0' in text
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        start_exporter(tmp_path / "missing", "127.0.0.1", 0)
