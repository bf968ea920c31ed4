"""benchmarks/_harness.use_source_kernels: a bare checkout's csrc/ as elastic_vllm.csrc (the GPU machine's copy of
the tree, where nothing is pip-installed)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def test_run_record_names_the_commit_given_by_the_device_caller(monkeypatch):
    from _harness import environment

    monkeypatch.setenv("GIT_COMMIT", "feedbeef")
    env = environment(("torch", "no_such_module_here"), argv=["python3", "benchmarks/x.py", "--out", "a b.json"])
    assert env["git_commit"] == "feedbeef" and env["git_commit_from"] == "GIT_COMMIT" and env["git_dirty"] is None
    assert env["command"] == "python3 benchmarks/x.py --out 'a b.json'"
    assert env["torch"] and env["gpu"] and env["no_such_module_here"].startswith("unavailable (")
    assert len(env["csrc_sha256"]) == 64


def test_quantiles_and_atomic_json(tmp_path):
    from _harness import quantiles, write_json

    assert quantiles([5.0, 1.0, 3.0]) == {"median": 3.0, "p20": 1.0, "p80": 5.0, "min": 1.0}
    assert quantiles([4.0, 1.0, 2.0, 3.0])["median"] == 2.5
    with pytest.raises(ValueError, match="no samples"):
        quantiles([])
    out = tmp_path / "sub" / "r.json"
    write_json(out, {"a": Path("/x")})
    assert out.read_text() == '{\n "a": "/x"\n}' and not list(out.parent.glob("*.tmp"))


def test_correctness_gate_follows_the_flash_attention_rule():
    import torch
    from _harness import gate

    ref = torch.zeros(4)
    base = torch.tensor([0.0, 0.01, 0.0, 0.0])  # PyTorch in the kernel's dtype: error 0.01 -> bound 0.021
    assert gate(torch.tensor([0.0, 0.0, 0.02, 0.0]), ref, base)["ok"]
    assert not gate(torch.tensor([0.0, 0.0, 0.03, 0.0]), ref, base)["ok"]
    assert not gate(torch.tensor([0.0, float("nan"), 0.0, 0.0]), ref, base)["ok"]


def test_a_baseline_server_takes_no_elastic_settings():
    from elastic_vllm.server import ServeProcess

    with pytest.raises(ValueError, match="need backend 'elastic'"):
        ServeProcess("model", elastic={"sink": 16}, backend="CPU_ATTN")
