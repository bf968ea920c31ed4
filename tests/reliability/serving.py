"""Helpers of the reliability tests: the shared `elastic-vllm serve` (demo model, random router), its
/metrics, the RSS of its process tree, prompts of a given length."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from elastic_vllm.server import ServeProcess, metric_value

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "smollm2"
MAX_MODEL_LEN = 2048
# 46,080 bytes per token (30 layers x 3 KV heads x 64 x K,V x float32): 101 MiB = 2,176 tokens, just
# above one max_model_len request, so that a few concurrent long requests force preemption
KV_BYTES = "101M"
ELASTIC = {"sink": 16, "window": 64}  # short prompts: keep the SSA masks non-trivial
SERVE_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", KV_BYTES,
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
]  # fmt: skip
STARTUP_S = 900


def subprocess_env() -> dict[str, str]:
    """The repository first on PYTHONPATH: `vllm serve` and its spawned processes import the plugin from
    this working tree (whatever an editable install points to)."""
    paths = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {"PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_rss(root: int) -> int:
    """Resident memory (VmRSS, bytes) of a process and all its descendants."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    """n random token ids of the SmolLM2 vocabulary (49,152), away from the special tokens."""
    return [rng.randrange(100, 49_000) for _ in range(n)]


def own_server(tmp_path_factory, name: str, elastic: dict, args: list[str]):
    """A module's own `elastic-vllm serve` of the demo model (a configuration the shared server cannot have):
    yields the ready ServeProcess, stops it afterwards. Use from a module-scoped fixture (``yield from``)."""
    from elastic_vllm.models import fetch_demo_model

    s = ServeProcess(
        fetch_demo_model(quiet=True), elastic=elastic, args=args, served_name=MODEL_NAME, env=subprocess_env(),
        log_path=tmp_path_factory.mktemp(name) / "serve.log",
    )  # fmt: skip
    try:
        s.wait_ready(STARTUP_S)
        yield s
    finally:
        s.stop()


class SharedServer:
    """`elastic-vllm serve` of the demo model with a random router (routing runs and is recorded; its
    decisions do not matter here), started in the background right after collection."""

    def __init__(self) -> None:
        from elastic_vllm.models import fetch_demo_model

        from .startup_cases import save_router

        self.tmp = Path(tempfile.mkdtemp(prefix="elastic-reliability-"))
        router = save_router(self.tmp / "router", seed=0)
        self.serve = ServeProcess(
            fetch_demo_model(quiet=True),
            elastic={**ELASTIC, "router_path": str(router)},
            args=[*SERVE_ARGS, "--enable-scale-out"],  # + vLLM's token endpoint, /inference/v1/generate
            served_name=MODEL_NAME,
            env=subprocess_env(),
            log_path=self.tmp / "serve.log",
        )
        self.base = self.serve.base
        self.rss_ready: int | None = None
        self.ready_s: float | None = None

    def wait_ready(self) -> SharedServer:
        if self.rss_ready is None:
            self.serve.wait_ready(STARTUP_S)
            self.ready_s = time.time() - self.serve.started
            self.rss_ready = tree_rss(self.serve.proc.pid)
        return self

    @property
    def pid(self) -> int:
        return self.serve.proc.pid

    def metrics(self) -> str:
        return self.serve.metrics()

    def log(self) -> str:
        return self.serve.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.serve.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def delta(before: str, after: str, name: str, **labels: str) -> float:
    return metric_value(after, name, **labels) - metric_value(before, name, **labels)


def wait_until(pred, timeout_s: float = 60, interval_s: float = 0.25):
    """Poll ``pred()`` until it returns a truthy value; return the last value (falsy on timeout)."""
    end = time.time() + timeout_s
    while True:
        value = pred()
        if value or time.time() > end:
            return value
        time.sleep(interval_s)
