"""benchmarks/_harness.use_source_kernels: a bare checkout's csrc/ as elastic_vllm.csrc (the GPU machine's copy of
the tree, where nothing is pip-installed)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import use_source_kernels  # noqa: E402


def test_maps_the_given_tree_even_when_another_csrc_is_installed(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "__init__.py").write_text("TREE = 'other'\n")
    (tmp_path / "csrc" / "prefill.py").write_text("WHO = 'other prefill'\n")
    code = (
        "import elastic_vllm.csrc as before, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from _harness import use_source_kernels\n"
        f"use_source_kernels({str(tmp_path)!r})\n"
        "import elastic_vllm.csrc as c\n"
        "from elastic_vllm.csrc import prefill\n"
        "print(before.__file__ != c.__file__, c.TREE, prefill.WHO)\n"
        f"use_source_kernels({str(ROOT)!r})\n"
        "import elastic_vllm.csrc as back\n"
        "from elastic_vllm.csrc import prefill\n"
        "print(hasattr(back, 'TREE'), hasattr(prefill, 'prefill_attention'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True other other prefill", "False True"]


def test_refuses_a_folder_without_kernels(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a source checkout"):
        use_source_kernels(tmp_path)
