"""What every benchmark here (and the GPU checks of tests/gpu/) shares: the run's record (machine, versions,
commit, command), timing, the correctness gate, JSON written atomically, and running from a bare checkout.

A benchmark script imports it as ``_harness`` (the script's folder is first on sys.path); tests/gpu/ puts
benchmarks/ on sys.path. Nothing here decides which measurements run: a script runs the jobs it is asked for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[1]
T0 = time.time()


def log(msg: object) -> None:
    """A progress line with the seconds since the script started."""
    print(f"[{time.time() - T0:6.0f}s] {msg}", flush=True)


# --- running from a bare checkout (the GPU machine's copy of the tree: nothing pip-installed) ---------------
def use_source_kernels(root: Path | str = ROOT) -> None:
    """Make ``elastic_vllm.csrc`` the package of ``root/csrc`` (setup.py installs csrc/ under that name; a bare
    checkout has no such package), also when another one (an editable install of a different checkout) is
    importable: a benchmark times and checks the kernels of its own tree."""
    import elastic_vllm

    csrc = (Path(root) / "csrc").resolve()
    if not (csrc / "__init__.py").is_file():
        raise FileNotFoundError(f"{csrc}/__init__.py: not a source checkout of elastic-vllm")
    spec = importlib.util.find_spec("elastic_vllm.csrc")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is not None and origin.parent == csrc:
        return
    spec = importlib.util.spec_from_file_location(
        "elastic_vllm.csrc", csrc / "__init__.py", submodule_search_locations=[str(csrc)]
    )
    for name in [n for n in sys.modules if n.startswith("elastic_vllm.csrc.")]:
        del sys.modules[name]  # submodules of the previous mapping
    mod = importlib.util.module_from_spec(spec)
    sys.modules["elastic_vllm.csrc"] = mod
    spec.loader.exec_module(mod)
    elastic_vllm.csrc = mod


def _pydantic_stand_in() -> types.ModuleType:
    mod = types.ModuleType("pydantic")

    class BaseModel:
        model_fields: ClassVar[dict] = {}

        def __init__(self, **kw):
            for k, v in kw.items():
                setattr(self, k, v)

    class ValidationError(ValueError):
        pass

    mod.BaseModel = BaseModel
    mod.ValidationError = ValidationError
    mod.ConfigDict = dict
    mod.Field = lambda default=None, **kw: default
    mod.model_validator = lambda **kw: lambda f: f
    mod.field_validator = lambda *a, **kw: lambda f: f
    mod.__elastic_stand_in__ = True
    return mod


def bootstrap() -> None:
    """The repository root on sys.path, ``elastic_vllm.csrc`` -> this tree's csrc/, and, when pydantic is absent
    (the GPU image has only torch, triton, numpy), a minimal stand-in so that ``elastic_vllm.config`` (imported by
    the reference package for HeadMode) loads; the kernel scripts never validate an ElasticConfig."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import pydantic  # noqa: F401
    except ImportError:
        sys.modules["pydantic"] = _pydantic_stand_in()
    use_source_kernels(ROOT)


# --- the run's record --------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance(argv: list[str] | None = None) -> dict:
    """Command, commit and time. GIT_COMMIT first: the device machine gets the tree without .git (or a stale one)."""
    argv = [sys.executable, *sys.argv] if argv is None else argv
    in_git = (ROOT / ".git").exists()
    given = os.environ.get("GIT_COMMIT")
    return {
        "command": " ".join(shlex.quote(a) for a in argv),
        "git_commit": given or (_git("rev-parse", "HEAD") if in_git else "") or "unknown",
        "git_commit_from": "GIT_COMMIT" if given else ("git" if in_git else "none"),
        "git_dirty": None if given or not in_git else bool(_git("status", "--porcelain", "--untracked-files=no")),
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


def environment(modules: tuple[str, ...] = ("torch", "triton"), argv: list[str] | None = None) -> dict:
    """Everything a result file records about its run: provenance, versions and which kernel sources ran."""
    return {**provenance(argv), **versions(modules), "csrc_sha256": csrc_sha256()}


def sha256_file(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def csrc_sha256(root: Path = ROOT) -> str:
    """One hash of the kernel sources (csrc/*.py, by name): which kernels a result timed when the tree is not a git
    checkout (the device machine) or when two trees are compared."""
    h = hashlib.sha256()
    for f in sorted((root / "csrc").glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def write_json(path: str | os.PathLike | None, payload: dict) -> None:
    """Write atomically (a run cut short leaves the last complete file, never half of one)."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(p)


# --- timing --------------------------------------------------------------------------------------------------
def quantiles(samples: list[float]) -> dict:
    """Median with p20 / p80 of repeated measurements (any unit)."""
    s = sorted(samples)
    if not s:
        raise ValueError("quantiles of no samples")
    mid = len(s) // 2
    med = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    return {"median": med, "p20": s[len(s) // 5], "p80": s[min(len(s) - 1, (4 * len(s)) // 5)], "min": s[0]}


def bench(fn, est_ms: float | None = None, min_reps: int = 3, cuda: bool | None = None) -> dict:
    """ms of ``fn`` on the GPU: triton.testing.do_bench median and p20/p80, >= 100 ms of repetitions and at least
    ``min_reps`` calls (slow calls: the spread was < 1% on the H200), warm-up <= 0.5 s. Off the GPU (``cuda``
    False, default: whether CUDA is available) one timed call: plumbing runs under the Triton interpreter, where
    the number means nothing."""
    import torch

    if not (torch.cuda.is_available() if cuda is None else cuda):
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return {"ms": ms, "p20": ms, "p80": ms}
    from triton.testing import do_bench

    if est_ms is None:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t) * 1e3
    rep = min(max(100.0, min_reps * est_ms), 2500.0)
    warm = min(max(25.0, est_ms), 500.0)
    med, p20, p80 = do_bench(fn, warmup=warm, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"ms": med, "p20": p20, "p80": p80}


# --- correctness gate ----------------------------------------------------------------------------------------
def gate(out, ref, base, floor: float = 1e-3) -> dict:
    """The flash-attention rule: the kernel's max error against the fp32 reference ``ref`` at most twice that of
    PyTorch in the kernel's dtype (``base``) plus ``floor``. NaN anywhere fails."""
    err = float((out.float() - ref.float()).abs().max())
    bound = 2 * float((base.float() - ref.float()).abs().max()) + floor
    return {"err": err, "bound": bound, "ok": err <= bound}
