"""Startup validation against real vLLM: a router checkpoint for another model (layers / KV heads /
head_dim), a truncated or corrupted checkpoint file (sha256 mismatch), an unknown mode, invalid
config values. A real `elastic-vllm serve` must exit non-zero with one log line naming the problem;
every case also runs in an in-process vLLM engine, which must raise the project's error with the
message. (The loader and the config parser alone: tests/router/test_checkpoint.py, tests/test_config.py,
tests/test_fuzz.py.)"""

from __future__ import annotations

import pytest

from .startup_cases import CASES, SERVE_CASES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", SERVE_CASES)
def test_serve_exits_nonzero_with_one_line_naming_the_problem(startup_jobs, name):
    case = CASES[name]
    rc, log = startup_jobs.serve_result(name)
    tail = log[-6000:]
    assert rc is not None, f"`elastic-vllm serve` with {name} was still running (it must refuse to start):\n{tail}"
    assert rc != 0, f"exit code 0 for {name}:\n{tail}"
    assert "Application startup complete" not in log, f"the server came up with {name}"
    lines = [line for line in log.splitlines() if f"{case.error}: " in line]
    assert lines, f"no line names {case.error} for {name}:\n{tail}"
    naming = [line for line in lines if all(f in line for f in case.fragments)]
    assert naming, f"no single line holds all of {case.fragments}; candidates:\n" + "\n".join(lines)
    # the error is the project's own, raised while the engine builds the model (before any weight loads)
    assert f"elastic_vllm.{'config' if case.error == 'ConfigError' else 'router.checkpoint'}.{case.error}" in naming[0]


@pytest.mark.parametrize("name", list(CASES))
def test_engine_refuses_bad_config_naming_the_problem(startup_jobs, name):
    case = CASES[name]
    res = startup_jobs.engine_results()[name]
    assert res["error"] is not None, f"the engine started with {name}"
    assert res["error"] == case.error, res.get("traceback", res)
    msg = res["message"].strip()
    assert "\n" not in msg, f"the error is not one line: {msg!r}"
    missing = [f for f in case.fragments if f not in msg]
    assert not missing, f"{missing} not in {msg!r}"
