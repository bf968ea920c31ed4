"""Running from a source checkout without ``pip install``: the kernels' package.

setup.py installs ``csrc/`` (the kernel sources) as ``elastic_vllm.csrc``; a bare checkout (the GPU machine's
copy of the tree, where nothing is installed) has no such package. ``use_source_kernels(root)`` maps it to
``root/csrc`` for this process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def use_source_kernels(root: Path | str) -> None:
    """Make ``elastic_vllm.csrc`` the package of ``root/csrc``, also when another one (an editable install of
    a different checkout) is importable: a benchmark times and checks the kernels of its own tree."""
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
