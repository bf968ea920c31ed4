"""``elastic-vllm serve``: run ``vllm serve`` with Prometheus multiprocess mode prepared, and supervise it.

The routing metrics are written in the engine process; the API server's /metrics shows them only when
every process shares a fresh PROMETHEUS_MULTIPROC_DIR, set before any of them imports prometheus_client.
This wrapper makes one per run with ``mkdtemp`` (a private, unpredictable name) and removes it when the
server exits, adds ``--attention-backend elastic`` unless another backend is named, defaults the model
to the demo model, checks the elastic configuration and the router against a local model's config.json
(``precheck.check_serve_args``: a bad one stops in 0.5-5 s, before vLLM is imported), and runs ``vllm serve``
as its child:

- the child's output goes through unchanged and into a log file (named on the first line); a clean exit
  removes it, a failed one keeps it and ends with one line: what happened, the fix and the log's path;
- the exit code comes from the processes, never from the log's text (a client can put any word in it):
  a stop that was asked for (SIGTERM / SIGHUP / SIGINT to the wrapper) exits 0, unless an engine core
  process had ended before it; an engine core process (vLLM's ``VLLM::EngineCore``, a child of the API
  server) that ends while nobody asked for a stop exits 1, and so does an API server that exits 0 on its
  own (vLLM's launcher stops uvicorn normally when its engine is gone, ``terminate_if_errored``); any
  other exit keeps the server's code;
- SIGTERM / SIGHUP to the wrapper go to the server; SIGINT reaches both (same process group), the
  wrapper waits for the server to stop.

Why one file of ~430 lines: one supervised child, whose start (argv, multiprocess folder, checks), watch (the
engine core processes) and end (exit code, root cause, fix) read the same state.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PREFIX = "elastic-vllm-prom-"
LOG_PREFIX = "elastic-vllm-serve-"
EXIT_ENGINE_DIED = 1
# vLLM's engine core processes title themselves VLLM::EngineCore (VLLM::EngineCore_DP<n> with data parallelism)
ENGINE_PROCESS = "EngineCore"
WATCH_S = 0.25  # how often the wrapper looks at the server's processes
# vLLM's API server stops on its own once its engine core is gone (4.2 s after `kill -9` on the idle CPU machine,
# still up after 15 s at load average 20 on its 2 cores); the wrapper does not wait for that: it stops a server this long
# after it saw the engine gone (SIGTERM; SIGKILL when it is still up KILL_AFTER_S later), as it serves nothing then
ENGINE_GONE_GRACE_S = 5.0
KILL_AFTER_S = 10.0
# processes of the server's tree still alive this long after the API server exited (vLLM's VLLM::Worker outlived its
# killed engine core by 52 s, holding the output pipe, so the wrapper did not end): SIGTERM, SIGKILL KILL_AFTER_S later
LEFTOVER_GRACE_S = 3.0
# what vLLM (0.26, 0.32) logs when the engine core process is gone (core_client / async_llm): used only to pick
# the line that explains a failure, never to decide one
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
# vLLM's exceptions that only point at the real one, logged before them ("Engine core initialization failed. See root
# cause above."): the root cause is that one
POINTER = re.compile(r"See root cause above|Engine core initialization failed")
_EXCEPTION = re.compile(r"(?:^|\s)((?:\w+\.)*\w*(?:Error|Exception)): \S")


def root_cause(log: str) -> str | None:
    """The line of a server log that says why it stopped, from the exception's name on: the project's own
    error (ConfigError, RouterCheckpointError, ...: raised from ``elastic_vllm.``), else the last exception line
    that is not only a pointer to an earlier one (:data:`POINTER`), else the last exception line, else vLLM's
    engine-death line, else the last ERROR line; None when there is none."""
    # this wrapper's own summary line (a ServeProcess log holds it) repeats a cause with its fix: used only when
    # nothing else says why (the wrapper's own check stopped it before vLLM ran)
    lines = [x.strip() for x in log.splitlines() if x.strip() and not x.startswith(SUMMARY)]
    own = [m.group(1) for m in map(_SUMMARY_CAUSE.match, log.splitlines()) if m]

    def exception(line: str) -> str | None:
        m = _EXCEPTION.search(line)
        return line[m.start(1) :] if m else None

    for pick in (
        lambda x: (e := exception(x)) and e.startswith("elastic_vllm.") and e,
        lambda x: (e := exception(x)) and not e.startswith("KeyboardInterrupt") and not POINTER.search(e) and e,
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
    if "--additional-config" in cause:
        return (
            "write it as one JSON object in single quotes, keys and strings in double quotes, e.g. "
            """--additional-config '{"elastic": {"window": 512}}'"""
        )
    if "ConfigError" in cause:
        return "correct what the line names; every field with its type and bounds: README.md, 'Configuration'"
    if "RouterCheckpointError" in cause:
        return "pass a router trained for this model (router.json + router.safetensors) as elastic.router_path"
    if ENGINE_DIED.search(cause):
        return "the engine process was killed or crashed (out of memory?); restart the server"
    return "this is vLLM's own error: correct the option or file it names (`vllm serve --help` lists vLLM's options)"


class Supervisor:
    """What the server's processes did, watched from a thread: whether a stop was asked (the wrapper's signal
    handlers call :meth:`stop_asked_now`) and whether an engine core process ended before that. Only process
    facts decide the exit code (:meth:`exit_code`)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.stop_asked: float | None = None  # time.monotonic() of the first stop signal while the server ran
        self.engine_gone: str | None = None  # the engine core process that ended before any stop was asked
        self.engine_gone_at: float | None = None
        self.engines_seen = 0
        self.signalled = 0  # stop signals the wrapper sent to a server that outlived its engine
        self._engines: dict = {}  # pid -> (psutil.Process, name) of the engine core processes alive at the last look
        self._tree: dict = {}  # pid -> psutil.Process of every process seen under the server (orphans included)
        self.server_exited_at: float | None = None
        self.leftovers_signalled = 0  # signals sent to processes of the tree that outlived the API server
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="elastic-vllm-serve-watch", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (the server has exited), after a last look at the engines it was seen with."""
        self._done.set()
        self._thread.join(timeout=5)
        self._sweep()

    def stop_asked_now(self) -> None:
        if self.stop_asked is None and self.proc.poll() is None:
            self.stop_asked = time.monotonic()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_S):
            self._sweep()
            if self.proc.poll() is not None:
                self._end_leftovers()
            elif self.engine_gone_at is not None and self.stop_asked is None:
                waited = time.monotonic() - self.engine_gone_at
                if self.signalled == 0 and waited > ENGINE_GONE_GRACE_S:
                    self.proc.send_signal(signal.SIGTERM)
                    self.signalled += 1
                elif self.signalled == 1 and waited > ENGINE_GONE_GRACE_S + KILL_AFTER_S:
                    self.proc.send_signal(signal.SIGKILL)
                    self.signalled += 1

    def _end_leftovers(self) -> None:
        """The API server has exited: what is left of its tree (orphans: nobody serves their results, and they
        hold the output pipe the wrapper reads to its end) gets SIGTERM after LEFTOVER_GRACE_S, SIGKILL KILL_AFTER_S
        later."""
        import psutil

        now = time.monotonic()
        if self.server_exited_at is None:
            self.server_exited_at = now
        waited = now - self.server_exited_at
        if self.leftovers_signalled == 0 and waited > LEFTOVER_GRACE_S:
            sig = signal.SIGTERM
        elif self.leftovers_signalled == 1 and waited > LEFTOVER_GRACE_S + KILL_AFTER_S:
            sig = signal.SIGKILL
        else:
            return
        self.leftovers_signalled += 1
        with self._lock:
            for p in self._tree.values():
                if _alive(p):
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)  # psutil checks the pid still names the process it saw

    def _sweep(self) -> None:
        """Note the engine core processes under the server, and the first one to end before any stop was asked."""
        import psutil

        with self._lock:  # the watch thread and close()
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                children = []  # the server has exited: its engines are still checked below
            for c in children:
                self._tree.setdefault(c.pid, c)
                if c.pid not in self._engines and _is_engine(c):
                    self._engines[c.pid] = (c, _name(c))
                    self.engines_seen += 1
            for pid, (c, name) in list(self._engines.items()):
                if _alive(c):
                    continue
                del self._engines[pid]
                if self.stop_asked is None and self.engine_gone is None:
                    self.engine_gone = f"the engine core process ({name}, pid {pid})"
                    self.engine_gone_at = time.monotonic()

    def exit_code(self, server_rc: int) -> tuple[int, str | None]:
        """(the wrapper's exit code, what went wrong) from the server's exit code ``server_rc`` (Popen's: -N for
        signal N) and what the watch saw. What went wrong is None for a normal stop and for a server that failed
        with an exit code of its own (its log's root cause says why)."""
        if self.engine_gone is not None and (server_rc == 0 or self.signalled):
            return EXIT_ENGINE_DIED, (
                f"{self.engine_gone} ended while the server was running, before any stop was asked "
                f"[vllm serve itself exited with code {server_rc}]"
            )
        if self.stop_asked is not None and self.engine_gone is None:
            return 0, None  # asked to stop, and nothing had failed before: a normal stop
        if server_rc == 0:
            return EXIT_ENGINE_DIED, (
                "vllm serve exited with code 0 on its own, without a stop being asked (vLLM does so when its "
                "engine fails)"
            )
        return (server_rc if server_rc >= 0 else 128 - server_rc), None  # signal N -> 128 + N, as a shell says


def _is_engine(p) -> bool:
    import psutil

    try:
        return ENGINE_PROCESS in p.name() or any(ENGINE_PROCESS in a for a in p.cmdline()[:1])
    except psutil.Error:
        return False


def _name(p) -> str:
    import psutil

    try:
        return next((a for a in p.cmdline()[:1] if ENGINE_PROCESS in a), p.name())
    except psutil.Error:
        return "?"


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # a zombie ended; its parent has not reaped it
    except psutil.Error:
        return False


# the files vLLM reads a model's configuration from: Hugging Face's config.json, or params.json (Mistral's format)
MODEL_CONFIG_FILES = ("config.json", "params.json")
MODEL_FIX = (
    "pass a model folder (config.json, tokenizer, *.safetensors) or a Hugging Face model id such as "
    "HuggingFaceTB/SmolLM2-135M-Instruct; `elastic-vllm fetch-model` prints the demo model's folder"
)


def local_model_problem(model: str) -> str | None:
    """What is missing for ``model`` as a local model, or None: a model folder (or file: vLLM reads GGUF files), or
    not a local path at all. A Hugging Face id ("name" or "org/name", nothing on disk) goes to vLLM unchanged: it
    resolves it, or names the problem, itself. A path is what starts with "/", "./", "../" or "~", holds more than
    one "/" (no hub id does), or exists."""
    path = Path(model).expanduser()
    if not (model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or path.exists()):
        return None
    if not path.exists():
        return f"model {model}: no such file or folder"
    if path.is_dir() and not any((path / f).is_file() for f in MODEL_CONFIG_FILES):
        return f"model {model}: the folder holds no config.json, so it is not a model folder"
    return None


def run_serve(model: str | None, extra: list[str]) -> int:
    """Run ``vllm serve`` (see the module docstring); returns the exit code for the wrapper."""
    problem = local_model_problem(model) if model is not None else None
    if problem:  # vLLM says so only after its import, in a traceback
        print(f"elastic-vllm serve: error: {problem} (fix: {MODEL_FIX})", file=sys.stderr)
        return 2
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
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in extra):  # vLLM's help: nothing to supervise
        return subprocess.call(argv, env=env)
    fd, log_name = tempfile.mkstemp(prefix=LOG_PREFIX, suffix=".log")
    log_path = Path(log_name)
    shown = " ".join(["vllm", *argv[3:]])  # as typed on a shell
    print(f"elastic-vllm serve: {shown} (log: {log_path})", file=sys.stderr, flush=True)
    try:
        with os.fdopen(fd, "w") as log:
            try:
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            except FileNotFoundError as e:
                e.filename = argv[0]
                raise
            watch = Supervisor(proc).start()

            def forward(s, _frame):
                watch.stop_asked_now()
                proc.send_signal(s)

            def interrupted(_s, _frame):  # the server got it too (same process group): wait for it to stop
                watch.stop_asked_now()

            handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
            signal.signal(signal.SIGTERM, forward)
            signal.signal(signal.SIGHUP, forward)
            signal.signal(signal.SIGINT, interrupted)
            try:
                assert proc.stdout is not None
                for raw in iter(proc.stdout.readline, b""):
                    line = raw.decode(errors="replace")
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    log.write(line)
                    log.flush()
                server_rc = proc.wait()
            finally:
                watch.close()
                for s, h in handlers.items():
                    signal.signal(s, h)
        rc, what = watch.exit_code(server_rc)
        if rc == 0:
            log_path.unlink(missing_ok=True)
        else:
            if what is None:
                what = root_cause(log_path.read_text(errors="replace")) or f"vllm serve exited with code {server_rc}"
                fix = fix_for(what)
            elif watch.engine_gone is not None:
                fix = (
                    "restart the server; an engine core the kernel killed (out of memory) is named in `dmesg`, "
                    "a crash ends the full log with its exception"
                )
            else:
                fix = "restart the server; the full log's last exception says why its engine failed"
            print(
                f"elastic-vllm serve: error: {what} (fix: {fix}; full log: {log_path})",
                file=sys.stderr,
                flush=True,
            )
        return rc
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
