"""`elastic-vllm serve` as a supervisor, against a stand-in ``vllm`` (a script that
prints a given log and exits with a given code), so that every outcome runs in a second:

- a clean exit: code 0, the log file and the Prometheus folder removed;
- a failed start: the child's code, and a last line with the root cause, the fix and the kept log's path;
- an engine that died while vLLM's API server exits 0 (what vLLM does): exit 1, the line says so;
- the Prometheus folder: ``mkdtemp`` (private, unpredictable), set for the child only, removed in every case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# a config.json of the demo model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64)
SHIPPED_CONFIG = Path(__file__).resolve().parent / "smollm2_config.json"

CONFIG_FAIL = """\
INFO 12-03 16:45:01 [utils.py:1] vLLM API server version 0.32.0
Traceback (most recent call last):
  File "/x/vllm/engine/arg_utils.py", line 1, in create_engine_config
elastic_vllm.config.ConfigError: invalid elastic config: elastic.window: Input should be a valid integer (got True)
"""
ENGINE_DIED = """\
(APIServer pid=1) INFO:     Application startup complete.
(APIServer pid=1) ERROR 12-03 16:50:00 [core_client.py:608] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.
(APIServer pid=1) INFO:     Shutting down
(APIServer pid=1) INFO:     Application shutdown complete.
"""
CLEAN = "INFO:     Application startup complete.\nINFO:     Shutting down\n"


def run_wrapper(tmp_path: Path, log: str, code: int, args: tuple[str, ...] = ()) -> tuple[int, str, str, dict]:
    """Run `elastic-vllm serve` with a stand-in vllm that prints ``log``, records its environment, exits ``code``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env_out = tmp_path / "child-env.txt"
    fake = bin_dir / "vllm"
    fake.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        open({str(env_out)!r}, "w").write(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
        sys.stdout.write({log!r})
        sys.exit({code})
        """)
    )
    fake.chmod(0o755)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    # the wrapper runs vLLM as `python -m vllm.entrypoints.cli.main` (test_telemetry checks that argv); here its
    # argv builder points at the stand-in, the rest of the wrapper runs unchanged
    driver = (
        "import sys; import elastic_vllm.telemetry.serve as s; from elastic_vllm.cli import main; "
        f"s.vllm_serve_argv = lambda model, extra: [{str(fake)!r}, 'serve', model, *extra]; "
        "sys.exit(main(sys.argv[1:]))"
    )
    p = subprocess.run(
        [sys.executable, "-c", driver, "serve", str(tmp_path / "model"), *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    ran = env_out.is_file()
    return p.returncode, p.stdout, p.stderr, {"prom": env_out.read_text() if ran else None, "tmp": tmp, "ran": ran}


def _log_path(stderr: str) -> Path:
    return Path(re.search(r"\(log: (\S+)\)", stderr).group(1))


def test_clean_exit_removes_log_and_metrics_folder(tmp_path):
    rc, out, err, seen = run_wrapper(tmp_path, CLEAN, 0)
    assert rc == 0, err
    assert out == CLEAN  # the child's output passes through unchanged
    prom = Path(seen["prom"])
    assert prom.parent == seen["tmp"] and re.fullmatch(r"elastic-vllm-prom-\w{8}", prom.name)
    assert not prom.exists() and not _log_path(err).exists()
    assert "error" not in err


def test_failed_start_ends_with_root_cause_fix_and_log_path(tmp_path):
    rc, _, err, seen = run_wrapper(tmp_path, CONFIG_FAIL, 1)
    assert rc == 1
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"elastic-vllm serve: error: (.*) \(fix: (.+); full log: (\S+)\)", last)
    assert m, last
    assert m.group(1).startswith("elastic_vllm.config.ConfigError: invalid elastic config: elastic.window")
    assert "Configuration" in m.group(2)
    assert Path(m.group(3)) == _log_path(err) and Path(m.group(3)).read_text() == CONFIG_FAIL
    assert not Path(seen["prom"]).exists()


@pytest.mark.parametrize(
    "elastic,want",
    [
        ({"window": True}, "elastic_vllm.config.ConfigError: invalid elastic config: elastic.window"),
        (
            {"router_path": "/no/such/router"},
            "RouterCheckpointError: router checkpoint /no/such/router is not a folder",
        ),
    ],
)
def test_bad_config_stops_before_vllm_starts(tmp_path, elastic, want):
    """The wrapper checks the configuration (and the router against a local model's config.json) itself:
    a bad one stops in about a second, before vLLM is even imported."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((SHIPPED_CONFIG).read_text())
    args = ("--additional-config", json.dumps({"elastic": elastic}))
    rc, _, err, seen = run_wrapper(tmp_path, CLEAN, 0, args)
    assert rc == 2 and not seen["ran"], err
    last = err.strip().splitlines()[-1]
    assert last.startswith("elastic-vllm serve: error: ") and want in last and "(fix: " in last, last
    assert not list(seen["tmp"].glob("elastic-vllm-prom-*"))


def test_engine_death_is_a_nonzero_exit_even_when_vllm_exits_0(tmp_path):
    rc, _, err, seen = run_wrapper(tmp_path, ENGINE_DIED, 0)
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert "Engine core proc EngineCore_DP0 died unexpectedly" in last and "full log: " in last, last
    assert "[vllm serve itself exited with code 0]" in last
    assert not Path(seen["prom"]).exists()


def test_signal_death_maps_to_128_plus_n(tmp_path):
    rc, _, err, _ = run_wrapper(tmp_path, "", -9)  # sys.exit(-9) -> 247; a real SIGKILL -> -9 from Popen
    assert rc == 247 and "error" in err


@pytest.mark.parametrize(
    "log,want",
    [
        (CONFIG_FAIL, "elastic_vllm.config.ConfigError: invalid elastic config: elastic.window"),
        (ENGINE_DIED, "Engine core proc EngineCore_DP0 died unexpectedly"),
        (
            "(EngineCore pid=2) ERROR x\nValueError: other\nelastic_vllm.router.checkpoint.RouterCheckpointError: "
            "router checkpoint /r was trained for other\nRuntimeError: Engine core initialization failed.",
            "elastic_vllm.router.checkpoint.RouterCheckpointError: router checkpoint /r was trained for other",
        ),
        (  # the project's error as vLLM's worker logs it, before the generic engine failure
            "(Worker pid=7) ERROR 12-03 17:01:08 [multiproc_executor.py:953] elastic_vllm.config.ConfigError: "
            "elastic: several shipped routers match smollm2\nRuntimeError: Engine core initialization failed.",
            "elastic_vllm.config.ConfigError: elastic: several shipped routers match smollm2",
        ),
        (CONFIG_FAIL + "elastic-vllm serve: error: X: y (fix: z; full log: /tmp/l)\n", "ConfigError: invalid"),
        ("elastic-vllm serve: error: elastic_vllm.config.ConfigError: bad (fix: z)\n", "ConfigError: bad"),
        ("nothing to see\n", None),
    ],
)
def test_root_cause(log, want):
    from elastic_vllm.telemetry.serve import root_cause

    got = root_cause(log)
    assert (got is None) if want is None else (want in got), got
