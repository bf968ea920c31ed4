"""The evaluation's prompts ship with the package: the harness reads them from elastic_vllm/eval/data/, and setup.py's
package_data names every file there (a wheel or a non-editable install has them; nothing reads the checkout)."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import elastic_vllm
from elastic_vllm.eval import engine, generalization

ROOT = Path(__file__).resolve().parents[2]


def package_data() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "package_data"))


def test_the_default_prompts_are_package_files():
    pkg = Path(elastic_vllm.__file__).resolve().parent
    for f in [*engine.DEFAULT_DATA, generalization.GEN_DATA, generalization.CALIB_DATA]:
        assert Path(f).is_file() and pkg in Path(f).resolve().parents, f


def test_setup_ships_every_data_file():
    globs = package_data()["elastic_vllm.eval"]
    files = [p.relative_to(ROOT / "elastic_vllm" / "eval").as_posix() for p in engine.DATA_DIR.iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
