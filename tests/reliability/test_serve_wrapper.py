"""`elastic-vllm serve` as a supervisor, against a stand-in vLLM (a script that prints a given log, starts a
stand-in engine core process when asked, and stops the way vLLM does), so that every outcome runs in seconds:

- a clean stop (SIGTERM to the wrapper, SIGINT to its process group): code 0, the log file and the Prometheus
  folder removed, even when the server's shutdown force-kills its engine core and logs ``EngineDeadError``
  (vLLM's own shutdown does, now and then);
- a failed start: the child's code, and a last line with the root cause, the fix and the kept log's path;
- an engine core process that ends while nobody asked for a stop: exit 1 while the stand-in API server exits 0
  (what vLLM does), whatever the log says; one that outlives its engine is stopped by the wrapper;
- the Prometheus folder: ``mkdtemp`` (private, unpredictable), set for the child only, removed in every case.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
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
# what vLLM's shutdown logged in 2 of 7 normal stops, after it force-killed its engine core
SHUTDOWN_KILLS_ENGINE = (
    "(APIServer pid=1) ERROR 12-03 17:00:00 [async_llm.py:700] AsyncLLM output_handler failed.\n"
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace for the root cause.\n"
)
# the stand-in engine core: titled as vLLM's (argv[0], as setproctitle leaves it), stops on SIGTERM / SIGINT
ENGINE = (
    "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(0)); print('up', flush=True); "
    "time.sleep(600)"
)


def stand_in(
    tmp_path: Path,
    log: str,
    code: int,
    engine: bool = False,
    wait: bool = False,
    on_stop: str = "",
    leftover: bool = False,
) -> Path:
    """A stand-in ``vllm serve``: records its environment, prints ``log``, starts a stand-in engine core when
    ``engine`` (and, with ``leftover``, a process that outlives it holding its output), writes ``ready`` (its
    engine's pid); then, with ``wait``, runs until SIGTERM / SIGINT and stops
    as vLLM does: force-kills the engine, prints ``on_stop``, exits ``code``; with an engine and no ``wait``,
    exits ``code`` when the engine ends (vLLM's API server exits 0 when its engine core dies); else at once."""
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import os, signal, subprocess, sys, time
        open({str(tmp_path / "child-env.txt")!r}, "w").write(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
        open({str(tmp_path / "child-argv.txt")!r}, "w").write(chr(10).join(sys.argv))
        sys.stdout.write({log!r})
        sys.stdout.flush()
        engine = None
        if {engine!r}:
            engine = subprocess.Popen(
                ["VLLM::EngineCore", "-c", {ENGINE!r}], executable=sys.executable, stdout=subprocess.PIPE
            )
            engine.stdout.readline()  # its SIGINT handler is set (a group SIGINT must not hit its start-up)
        if {leftover!r}:  # a process that outlives this one and holds its output (vLLM's orphaned VLLM::Worker)
            orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(tmp_path / "leftover")!r}, "w").write(str(orphan.pid))
        open({str(tmp_path / "ready")!r}, "w").write(str(engine.pid if engine else 0))

        def stop(*_):
            if engine is not None:
                engine.kill()
                engine.wait()
            sys.stdout.write({on_stop!r})
            sys.stdout.flush()
            os._exit({code})

        if {wait!r}:
            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
            while True:
                time.sleep(1)
        if engine is not None:
            engine.wait()
        sys.exit({code})
        """)
    )
    fake.chmod(0o755)
    return fake


def start_wrapper(tmp_path: Path, fake: Path, args: tuple[str, ...] = (), model: str | None = None, **consts: float):
    """`elastic-vllm serve MODEL` (its own process group) whose argv builder points at the stand-in; the rest of the
    wrapper runs unchanged (the wrapper runs vLLM as `python -m vllm.entrypoints.cli.main`, test_telemetry checks
    that argv). MODEL: a folder holding a config.json of no known shape (no router check) unless given; the file
    ``vllm-imported`` says whether the wrapper's own process imported vLLM."""
    if model is None:
        folder = tmp_path / "model"
        folder.mkdir(exist_ok=True)
        if not (folder / "config.json").exists():
            (folder / "config.json").write_text("{}")
        model = str(folder)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    driver = (
        f"import atexit, sys; atexit.register(lambda: open({str(tmp_path / 'vllm-imported')!r}, 'w')"
        ".write(str('vllm' in sys.modules)))\n"
        "import elastic_vllm.supervisor as s; from elastic_vllm.cli import main; "
        f"s.vllm_serve_argv = lambda model, extra: [{str(fake)!r}, 'serve', model, *extra]; "
        + "".join(f"s.{name} = {value!r}; " for name, value in consts.items())  # e.g. ENGINE_GONE_GRACE_S
        # a file once the watch has seen the engine core: the test kills it only after that (no timing)
        + f"sweep = s.Supervisor._sweep; seen = {str(tmp_path / 'seen')!r}\n"
        + "def _sweep(self):\n    sweep(self)\n    self.engines_seen and open(seen, 'w').close()\n"
        + "s.Supervisor._sweep = _sweep; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", driver, "serve", model, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    ), tmp  # fmt: skip


def finish(tmp_path: Path, proc: subprocess.Popen, tmp: Path, timeout_s: float = 120) -> tuple[int, str, str, dict]:
    out, err = proc.communicate(timeout=timeout_s)
    env_out = tmp_path / "child-env.txt"
    ran = env_out.is_file()
    return proc.returncode, out, err, {"prom": env_out.read_text() if ran else None, "tmp": tmp, "ran": ran}


def wait_ready(tmp_path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """The stand-in engine's pid (0: none), once the stand-in has started it and the wrapper's watch has seen it."""
    ready, seen = tmp_path / "ready", tmp_path / "seen"
    end = time.monotonic() + timeout_s
    while not (ready.is_file() and ready.read_text() and (ready.read_text() == "0" or seen.is_file())):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the stand-in vLLM did not start, or the wrapper did not see its engine"
        time.sleep(0.05)
    return int(ready.read_text())


def run_wrapper(
    tmp_path: Path, log: str, code: int, args: tuple[str, ...] = (), model: str | None = None
) -> tuple[int, str, str, dict]:
    """`elastic-vllm serve` with a stand-in vLLM that prints ``log`` and exits ``code`` on its own."""
    proc, tmp = start_wrapper(tmp_path, stand_in(tmp_path, log, code), args, model=model)
    return finish(tmp_path, proc, tmp)


def _log_path(stderr: str) -> Path:
    return Path(re.search(r"\(log: (\S+)\)", stderr).group(1))


@pytest.mark.parametrize("how", ["SIGTERM to the wrapper", "SIGINT to the group"])
@pytest.mark.parametrize("on_stop", ["", SHUTDOWN_KILLS_ENGINE], ids=["quiet", "engine-force-killed"])
def test_a_stop_that_was_asked_exits_0_and_removes_log_and_metrics_folder(tmp_path, how, on_stop):
    """The stand-in stops as vLLM's shutdown sometimes does: it force-kills its engine core and logs
    EngineDeadError; the stop was asked, so it is a normal one (a supervisor must not see a failure)."""
    proc, tmp = start_wrapper(tmp_path, stand_in(tmp_path, CLEAN, 0, engine=True, wait=True, on_stop=on_stop))
    wait_ready(tmp_path, proc)
    if how == "SIGTERM to the wrapper":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    rc, out, err, seen = finish(tmp_path, proc, tmp)
    assert rc == 0, err
    assert out == CLEAN + on_stop  # the child's output passes through unchanged
    prom = Path(seen["prom"])
    assert prom.parent == seen["tmp"] and re.fullmatch(r"elastic-vllm-prom-\w{8}", prom.name)
    assert not prom.exists() and not _log_path(err).exists()
    assert "error" not in err


def test_a_server_that_fails_after_a_stop_was_asked_still_stops_normally(tmp_path):
    """A non-zero exit of vLLM's shutdown after the stop was asked (nothing had failed before): a normal stop."""
    proc, tmp = start_wrapper(tmp_path, stand_in(tmp_path, CLEAN, 1, engine=True, wait=True))
    wait_ready(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    rc, _, err, _ = finish(tmp_path, proc, tmp)
    assert rc == 0, err


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


@pytest.mark.parametrize(
    "raw,want",
    [
        ('{"elastic": {window: 5}}', "--additional-config is not valid JSON: Expecting property name enclosed in "
         "double quotes at character 14 (got '{\"elastic\": {window: 5}}')"),
        ("", "--additional-config is not valid JSON: Expecting value at character 1 (got '')"),
        ('{"elastic": {"window": 5}', "--additional-config is not valid JSON: Expecting ',' delimiter"),
        ('[{"elastic": {}}]', "--additional-config must be a JSON object (got [{'elastic': {}}])"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("form", ["two args", "one arg"])
def test_bad_additional_config_json_stops_before_vllm_starts(tmp_path, raw, want, form):
    """Bad JSON in --additional-config: one line naming the problem and the fix, exit 2, vLLM never started (its own
    argparse refused it only after its import: 23 s, "vllm serve exited with code 2")."""
    args = ("--additional-config", raw) if form == "two args" else (f"--additional-config={raw}",)
    rc, _, err, seen = run_wrapper(tmp_path, CLEAN, 0, ("--port", "8001", *args, "--enforce-eager"))
    assert rc == 2 and not seen["ran"], err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("elastic-vllm serve: error: elastic_vllm.config.ConfigError: " + want), lines[0]
    assert "(fix: write it as one JSON object in single quotes" in lines[0], lines[0]
    assert not list(seen["tmp"].glob("elastic-vllm-prom-*"))


@pytest.mark.parametrize(
    "make,want",
    [
        (lambda tmp: "/nonexistent/model", "model /nonexistent/model: no such file or folder"),
        (lambda tmp: f"{tmp}/no/such/model", "/no/such/model: no such file or folder"),
        (lambda tmp: "./no-such-model-here", "model ./no-such-model-here: no such file or folder"),
        (lambda tmp: str(tmp), "the folder holds no config.json, so it is not a model folder"),
    ],
    ids=["absolute", "deep", "relative", "no-config-json"],
)
def test_a_missing_local_model_is_one_line_before_vllm(tmp_path, make, want):
    """A local path that does not exist or holds no model: one line naming the path and what is missing, exit 2,
    vLLM neither started nor imported (vLLM took 13 s and a 60-line traceback, ending "read the full log")."""
    (tmp_path / "empty-folder").mkdir()
    rc, _, err, seen = run_wrapper(tmp_path, CLEAN, 0, model=make(tmp_path / "empty-folder"))
    assert rc == 2 and not seen["ran"], err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-vllm serve: error: model ") and want in lines[0], err
    assert "(fix: pass a model folder (config.json, tokenizer, *.safetensors) or a Hugging Face model id" in lines[0]
    assert "read the full log" not in err
    assert (tmp_path / "vllm-imported").read_text() == "False"


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"])
def test_a_hub_id_goes_to_vllm_unchanged(tmp_path, model):
    """A model that is not a local path is vLLM's to resolve (no network is asked here)."""
    rc, _, err, seen = run_wrapper(tmp_path, CLEAN, 3, model=model)
    assert seen["ran"] and rc == 3, err
    assert (tmp_path / "child-argv.txt").read_text().splitlines()[1:3] == ["serve", model]


@pytest.mark.parametrize("log", ["", ENGINE_DIED], ids=["silent", "logged"])
def test_engine_death_is_a_nonzero_exit_even_when_vllm_exits_0(tmp_path, log):
    """The engine core process ends (SIGKILL) while nobody asked for a stop; the stand-in API server then exits 0,
    as vLLM's does. Decided from the processes: the same with or without vLLM's death line in the log."""
    proc, tmp = start_wrapper(tmp_path, stand_in(tmp_path, log, 0, engine=True))
    os.kill(wait_ready(tmp_path, proc), signal.SIGKILL)
    rc, _, err, seen = finish(tmp_path, proc, tmp)
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert "the engine core process (VLLM::EngineCore, pid " in last and "before any stop was asked" in last, last
    assert "[vllm serve itself exited with code 0]" in last and "full log: " in last, last
    assert not Path(seen["prom"]).exists()


def test_a_server_that_outlives_its_engine_is_stopped(tmp_path):
    """vLLM's API server stops on its own after its engine core died (4.2 s on the CPU build); one that does not
    is stopped by the wrapper after ENGINE_GONE_GRACE_S (here 1 s), and the exit is still 1."""
    proc, tmp = start_wrapper(tmp_path, stand_in(tmp_path, CLEAN, 0, engine=True, wait=True), ENGINE_GONE_GRACE_S=1.0)
    os.kill(wait_ready(tmp_path, proc), signal.SIGKILL)
    rc, _, err, _ = finish(tmp_path, proc, tmp, timeout_s=60)
    assert rc == 1, err
    assert "before any stop was asked" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("kill_engine", [False, True], ids=["stop", "engine-killed"])
def test_processes_left_after_the_server_do_not_keep_the_wrapper(tmp_path, kill_engine):
    """A process of the server's tree that outlives the API server (and holds its output pipe, which the wrapper
    reads to the end) is ended LEFTOVER_GRACE_S (here 0.5 s) after the server exited; the exit code is unchanged."""
    fake = stand_in(tmp_path, CLEAN, 0, engine=True, wait=not kill_engine, leftover=True)
    proc, tmp = start_wrapper(tmp_path, fake, LEFTOVER_GRACE_S=0.5)
    engine = wait_ready(tmp_path, proc)
    orphan = int((tmp_path / "leftover").read_text())
    if kill_engine:
        os.kill(engine, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGTERM)
    rc, _, err, _ = finish(tmp_path, proc, tmp, timeout_s=60)  # the orphan sleeps 600 s: without the wrapper's
    assert rc == (1 if kill_engine else 0), err  # SIGTERM this would time out
    import psutil

    try:
        assert psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE  # ended; init has not reaped it yet
    except psutil.NoSuchProcess:
        pass


def test_an_engine_death_before_the_stop_is_not_hidden_by_the_stop(tmp_path):
    proc, tmp = start_wrapper(tmp_path, stand_in(tmp_path, CLEAN, 0, engine=True, wait=True), ENGINE_GONE_GRACE_S=60.0)
    os.kill(wait_ready(tmp_path, proc), signal.SIGKILL)
    time.sleep(1.5)  # the watch sees the engine gone
    proc.send_signal(signal.SIGTERM)
    rc, _, err, _ = finish(tmp_path, proc, tmp)
    assert rc == 1, err
    assert "before any stop was asked" in err.strip().splitlines()[-1], err


def test_a_server_that_exits_0_unasked_is_a_failure(tmp_path):
    """vllm serve exiting 0 with no stop asked is what vLLM does when its engine fails (no engine process seen)."""
    rc, _, err, _ = run_wrapper(tmp_path, CLEAN, 0)
    assert rc == 1, err
    assert "exited with code 0 on its own, without a stop being asked" in err.strip().splitlines()[-1], err


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
        (  # vLLM's engine start failure points at the exception before it: that one is the root cause
            "(EngineCore pid=7808) ERROR 12-07 04:44:49 [core.py:1510] ValueError: To serve at least one request with "
            "the model's max seq len (2048), (0.09 GiB KV cache is needed\n"
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n",
            "ValueError: To serve at least one request with the model's max seq len (2048)",
        ),
        ("RuntimeError: Engine core initialization failed. See root cause above.\n", "RuntimeError: Engine core"),
        ("nothing to see\n", None),
    ],
)
def test_root_cause(log, want):
    from elastic_vllm.supervisor import root_cause

    got = root_cause(log)
    assert (got is None) if want is None else (want in got), got


def test_every_fix_says_what_to_do():
    from elastic_vllm.supervisor import fix_for

    for cause in ("ValueError: To serve at least one request ...", "OSError: x", "something else"):
        fix = fix_for(cause)
        assert "read the full log" not in fix and "correct the option or file it names" in fix, fix
