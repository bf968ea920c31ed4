"""No pickle: nothing in the package (elastic_vllm/, its kernels included) deserializes with pickle.
Router weights are read through safetensors only (router/checkpoint.py); ``torch.load`` is allowed only
with ``weights_only=True`` (a literal), ``numpy.load`` never with ``allow_pickle=True``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO / "elastic_vllm").rglob("*.py"))
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "pickletools"}
UNSAFE_CALLS = {"read_pickle", "loads_pickle", "jit.load", "package.PackageImporter"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = lambda n: f"{path.relative_to(REPO)}:{n.lineno}"  # noqa: E731
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{where(node)} import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in PICKLE_MODULES:
                found.append(f"{where(node)} from {node.module} import ...")
            if node.module in ("torch", "torch.serialization") and any(a.name == "load" for a in node.names):
                found.append(
                    f"{where(node)} from {node.module} import load (call it as torch.load(..., weights_only=True))"
                )
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("torch.load", "torch.serialization.load"):
                wo = _kw(node, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    found.append(f"{where(node)} {name} without weights_only=True")
            elif name in ("np.load", "numpy.load"):
                ap = _kw(node, "allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    found.append(f"{where(node)} {name} with allow_pickle")
            elif any(name == c or name.endswith("." + c) for c in UNSAFE_CALLS):
                found.append(f"{where(node)} {name}")
    return found


def test_sources_are_found():
    assert len(SOURCES) > 20 and (REPO / "elastic_vllm" / "router" / "checkpoint.py") in SOURCES


def test_no_pickle_deserialization_in_the_package():
    found = [v for path in SOURCES for v in violations(path)]
    assert not found, "pickle-based deserialization:\n" + "\n".join(found)


def test_grep_torch_load_lines_all_weights_only():
    """The plain-text view of the same rule (what `grep -rn torch.load elastic_vllm/` shows)."""
    bad = []
    for path in SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\btorch\.load\(", code) and "weights_only=True" not in code:
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
            if re.search(r"^\s*(import|from)\s+(c?pickle|_pickle|dill|cloudpickle|joblib)\b", code):
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_checker_catches_what_it_looks_for(tmp_path):
    """The AST rule itself: each forbidden form is reported, the allowed forms are not."""
    src = tmp_path / "sample.py"
    src.write_text(
        "import pickle\nfrom dill import loads\nimport torch, numpy as np\n"
        "torch.load('a')\ntorch.load('a', weights_only=False)\ntorch.load('a', weights_only=True)\n"
        "np.load('a', allow_pickle=True)\nnp.load('a')\nimport pandas as pd\npd.read_pickle('x')\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = violations(src)
    finally:
        REPO = saved
    lines = sorted(int(v.split(":")[1].split()[0]) for v in found)
    assert lines == [1, 2, 4, 5, 7, 10], found
