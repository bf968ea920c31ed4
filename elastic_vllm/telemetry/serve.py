"""``elastic-vllm serve``: run ``vllm serve`` with Prometheus multiprocess mode prepared, and supervise it.

The routing metrics are written in the engine process; the API server's /metrics shows them only when
every process shares a fresh PROMETHEUS_MULTIPROC_DIR, set before any of them imports prometheus_client.
This wrapper makes one per run with ``mkdtemp`` (a private, unpredictable name) and removes it when the
server exits, adds ``--attention-backend elastic`` unless another backend is named, defaults the model
to the demo model, checks the elastic configuration and the router against a local model's config.json
(``precheck.check_serve_args``: a bad one stops in 0.5-5 s, before vLLM is imported), and runs ``vllm serve``
as its child:

- the child's output goes through unchanged and into a log file (named on the first line); a clean exit
  removes it, a failed one keeps it and ends with one line: the root cause and the log's path;
- the exit code is the child's, except that a server whose engine died exits 1: vLLM's API server
  itself exits 0 then (``terminate_if_errored`` in vLLM's launcher stops uvicorn normally, whatever
  the attention backend), which restart-on-failure supervisors read as a clean stop;
- SIGTERM / SIGHUP to the wrapper go to the server; SIGINT reaches both (same process group), the
  wrapper waits for the server to stop.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PREFIX = "elastic-vllm-prom-"
LOG_PREFIX = "elastic-vllm-serve-"
EXIT_ENGINE_DIED = 1
# what vLLM (0.26, 0.32) logs when the engine core process is gone (core_client / async_llm)
ENGINE_DIED = re.compile(r"EngineDeadError|Engine core proc \S+ died unexpectedly|engine core .*died", re.IGNORECASE)


OWNER_FILE = "elastic-vllm-serve.pid"  # the wrapper's pid: a folder whose wrapper is gone (SIGKILL) is stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_multiproc_dir(base: str | None = None) -> Path:
    """A fresh, empty, private folder for this run (``mkdtemp``: mode 0700, unpredictable name), holding
    only the wrapper's pid (prometheus_client reads ``*.db`` files only); folders of earlier runs whose
    wrapper is gone without removing its own (killed) are removed."""
    root = Path(base or tempfile.gettempdir())
    for old in root.glob(f"{PREFIX}*"):
        try:
            pid = int((old / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or not readable by this user
        if not _pid_alive(pid):
            shutil.rmtree(old, ignore_errors=True)
    d = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    (d / OWNER_FILE).write_text(str(os.getpid()))
    return d


def vllm_serve_argv(model: str, extra: list[str]) -> list[str]:
    """``vllm serve`` through this interpreter's vLLM (the one the plugin is installed in): a ``vllm`` script on
    PATH may belong to another environment, and an environment on PYTHONPATH alone has none."""
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *extra]
    if not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in extra):
        argv += ["--attention-backend", "elastic"]
    return argv


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


SUMMARY = "elastic-vllm serve: error: "
_SUMMARY_CAUSE = re.compile(r"elastic-vllm serve: error: (.*?) \(fix: .*\)$")
# an exception line, after any prefix vLLM's loggers put before it ("(Worker pid=7) ERROR ... [file.py:1] ")
_EXCEPTION = re.compile(r"(?:^|\s)((?:\w+\.)*\w*(?:Error|Exception)): \S")


def root_cause(log: str) -> str | None:
    """The line of a server log that says why it stopped, from the exception's name on: the project's own
    error (ConfigError, RouterCheckpointError, ...: raised from ``elastic_vllm.``), else the last
    exception line, else vLLM's engine-death line, else the last ERROR line; None when there is none."""
    # this wrapper's own summary line (a ServeProcess log holds it) repeats a cause with its fix: used only when
    # nothing else says why (the wrapper's own check stopped it before vLLM ran)
    lines = [x.strip() for x in log.splitlines() if x.strip() and not x.startswith(SUMMARY)]
    own = [m.group(1) for m in map(_SUMMARY_CAUSE.match, log.splitlines()) if m]

    def exception(line: str) -> str | None:
        m = _EXCEPTION.search(line)
        return line[m.start(1) :] if m else None

    for pick in (
        lambda x: (e := exception(x)) and e.startswith("elastic_vllm.") and e,
        lambda x: (e := exception(x)) and not e.startswith("KeyboardInterrupt") and e,
        lambda x: ENGINE_DIED.search(x) and x,
        lambda x: " ERROR " in x and x,
    ):
        found = [c for c in map(pick, lines) if c]
        if found:
            return found[-1][:2000]
    return own[-1][:2000] if own else None


def fix_for(cause: str) -> str:
    """How to go on from a root cause (:func:`root_cause`)."""
    if "ConfigError" in cause:
        return "correct what the line names; every field with its type and bounds: README.md, 'Configuration'"
    if "RouterCheckpointError" in cause:
        return "pass a router trained for this model (router.json + router.safetensors) as elastic.router_path"
    if ENGINE_DIED.search(cause):
        return "the engine process was killed or crashed (out of memory?); restart the server"
    return "read the full log"


def run_serve(model: str | None, extra: list[str]) -> int:
    """Run ``vllm serve`` (see the module docstring); returns the exit code for the wrapper."""
    if model is None:
        from elastic_vllm.models import fetch_demo_model

        model = str(fetch_demo_model())
    if importlib.util.find_spec("vllm") is None:
        print(
            f"elastic-vllm serve: error: vLLM is not installed in this Python ({sys.executable}) "
            "(fix: bash scripts/install.sh: it installs vLLM, its CPU build when there is no NVIDIA GPU)",
            file=sys.stderr,
        )
        return 2
    try:
        from elastic_vllm.vllm_plugin.precheck import check_serve_args

        check_serve_args(model, extra)
    except ValueError as e:  # ConfigError, RouterCheckpointError: one line naming the problem
        cause = f"{type(e).__module__}.{type(e).__name__}: {e}"
        print(f"elastic-vllm serve: error: {cause} (fix: {fix_for(cause)})", file=sys.stderr)
        return 2
    env = dict(os.environ)
    made = None
    if env.get("PROMETHEUS_MULTIPROC_DIR"):
        d = Path(env["PROMETHEUS_MULTIPROC_DIR"])
        if d.is_dir() and any(d.iterdir()):
            print(
                f"elastic-vllm serve: error: PROMETHEUS_MULTIPROC_DIR={d} is not empty; metrics of an earlier run "
                "would mix with this one's (fix: unset it, the wrapper then makes a fresh one, or empty it)",
                file=sys.stderr,
            )
            return 2
        if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
            print(
                f"elastic-vllm serve: error: PROMETHEUS_MULTIPROC_DIR={d} is not a writable folder "
                "(fix: create it, or unset it: the wrapper then makes a fresh one)",
                file=sys.stderr,
            )
            return 2
    else:
        made = prepare_multiproc_dir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(made)
    if (
        not _has_cuda()
        and "VLLM_CPU_KVCACHE_SPACE" not in env
        and not any(a.startswith("--kv-cache-memory") for a in extra)
    ):
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; unbounded, vLLM's CPU build reserves most of the RAM
    argv = vllm_serve_argv(model, extra)
    fd, log_name = tempfile.mkstemp(prefix=LOG_PREFIX, suffix=".log")
    log_path = Path(log_name)
    shown = " ".join(["vllm", *argv[3:]])  # as typed on a shell
    print(f"elastic-vllm serve: {shown} (log: {log_path})", file=sys.stderr, flush=True)
    died = False
    try:
        with os.fdopen(fd, "w") as log:
            try:
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            except FileNotFoundError as e:
                e.filename = argv[0]
                raise
            forward = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
            signal.signal(signal.SIGTERM, lambda s, f: proc.send_signal(s))
            signal.signal(signal.SIGHUP, lambda s, f: proc.send_signal(s))
            signal.signal(signal.SIGINT, lambda s, f: None)  # the server got it too: wait for it to stop
            try:
                assert proc.stdout is not None
                for raw in iter(proc.stdout.readline, b""):
                    line = raw.decode(errors="replace")
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    log.write(line)
                    log.flush()
                    if not died and ENGINE_DIED.search(line):
                        died = True
                rc = proc.wait()
            finally:
                for s, h in forward.items():
                    signal.signal(s, h)
        vllm_rc = rc
        if rc == 0 and died:
            rc = EXIT_ENGINE_DIED
        if rc == 0:
            log_path.unlink(missing_ok=True)
        else:
            cause = root_cause(log_path.read_text(errors="replace")) or f"vllm serve exited with code {rc}"
            if died and not ENGINE_DIED.search(cause):
                cause = f"the engine died ({cause})"
            if died and vllm_rc == 0:
                cause += " [vllm serve itself exited with code 0]"
            print(
                f"elastic-vllm serve: error: {cause} (fix: {fix_for(cause)}; full log: {log_path})",
                file=sys.stderr,
                flush=True,
            )
        return rc if rc >= 0 else 128 - rc  # killed by signal N -> 128 + N, as a shell reports it
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
