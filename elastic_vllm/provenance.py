"""The record every result file carries: the command, the commit, the software versions and the GPU; and the JSON
written atomically. Shared by the benchmarks, the evaluation and the GPU checks.

The commit comes from ``GIT_COMMIT`` first: the GPU machine gets the tree without .git (or with a stale one).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def git(*args: str, cwd: Path = CHECKOUT) -> str:
    """``git args`` in the checkout this package runs from; "" where there is no git or no checkout."""
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance(argv: list[str] | None = None) -> dict:
    """Command, commit (and where it came from), whether tracked files differ from it, and the time."""
    argv = [sys.executable, *sys.argv] if argv is None else argv
    in_git = (CHECKOUT / ".git").exists()
    given = os.environ.get("GIT_COMMIT")
    return {
        "command": " ".join(shlex.quote(a) for a in argv),
        "git_commit": given or (git("rev-parse", "HEAD") if in_git else "") or "unknown",
        "git_commit_from": "GIT_COMMIT" if given else ("git" if in_git else "none"),
        "git_dirty": None if given or not in_git else bool(git("status", "--porcelain", "--untracked-files=no")),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def versions(modules: tuple[str, ...] = ("torch", "triton")) -> dict:
    """Python, each module's version (or why it is unavailable), the GPU; importing torch does not import
    triton, so TRITON_INTERPRET set by a script before this call still holds."""
    env = {"python": platform.python_version(), "host": platform.node(), "cpu_count": os.cpu_count()}
    for mod in modules:
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # ImportError, or a package's own import-time error
            env[mod] = f"unavailable ({type(e).__name__})"
    if "torch" in modules and "unavailable" not in env["torch"]:
        import torch

        env["cuda"] = torch.version.cuda
        env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        env["gpu_count"] = torch.cuda.device_count()
    return env


def kernel_sources_sha256(folder: Path | None = None) -> str:
    """One hash of the Triton kernel sources (every *.py under elastic_vllm/ops, by relative path): which kernels a
    result ran when the tree is not a git checkout (the device machine) or when two trees are compared."""
    folder = Path(__file__).resolve().parent / "ops" if folder is None else Path(folder)
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*.py")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def run_record(modules: tuple[str, ...] = ("torch", "triton"), argv: list[str] | None = None) -> dict:
    """Everything a result file records about its run: provenance, versions and which kernel sources ran."""
    return {**provenance(argv), **versions(modules), "ops_sha256": kernel_sources_sha256()}


def write_json(path: str | os.PathLike | None, payload: dict) -> None:
    """Write atomically (a run cut short leaves the last complete file, never half of one); no path: nothing."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(p)
