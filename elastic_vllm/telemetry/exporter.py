"""``elastic-vllm metrics-exporter``: one node's Prometheus multiprocess folder over HTTP.

The routing metrics are written by vLLM's worker processes. On the API server's node they reach its /metrics
(the folder is shared); a worker on another node (pipeline parallelism across nodes with vLLM's Ray backend)
writes into that node's folder, which no /metrics reads: this exporter serves it, so Prometheus scrapes every
node and sums. Each request is recorded by exactly one rank of the cluster (``vllm_plugin/parallel.py``), so
queries that sum without an ``instance`` label stay correct.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PROM_ENV = "PROMETHEUS_MULTIPROC_DIR"


def start_exporter(folder: str | Path, host: str, port: int):
    """Serve the samples of every process that wrote into ``folder`` at http://host:port/metrics (a daemon
    thread); returns the HTTP server (``.server_address``, ``.shutdown()``)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    d = Path(folder)
    if not d.is_dir():
        raise FileNotFoundError(f"metrics-exporter: {d} is not a folder (the workers' {PROM_ENV})")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(d))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def run_exporter(folder: str | None, host: str, port: int) -> int:
    folder = folder or os.environ.get(PROM_ENV)
    if not folder:
        raise ValueError(f"metrics-exporter: pass --dir or set {PROM_ENV} (the folder the workers write into)")
    server = start_exporter(folder, host, port)
    print(f"metrics-exporter: serving {folder} at http://{host}:{server.server_address[1]}/metrics", flush=True)
    threading.Event().wait()  # until interrupted
    return 0
