"""The plugin's log lines reach vLLM's handlers (a server's log) and still propagate to the root logger."""

from __future__ import annotations

import logging

from elastic_vllm.vllm_plugin import plugin


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_plugin_info_lines_reach_vllms_handlers_once(caplog):
    vllm_logger = logging.getLogger("vllm")
    collect = _Collect()
    vllm_logger.addHandler(collect)  # as vLLM's own configuration would, possibly after the plugin loaded
    try:
        plugin._share_vllm_logging()
        plugin._share_vllm_logging()  # idempotent: registered in every process, maybe more than once
        with caplog.at_level(logging.INFO, logger="elastic_vllm"):
            logging.getLogger("elastic_vllm.vllm_plugin.warmup").info("elastic: kernels warmed up")
    finally:
        vllm_logger.removeHandler(collect)
    assert collect.lines == ["elastic: kernels warmed up"]
    assert "elastic: kernels warmed up" in caplog.text
