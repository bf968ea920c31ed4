"""benchmarks/_harness.py: the run record, timing helpers, the correctness gate, and running this checkout's
package (kernels included) also where another checkout is installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_script_measures_its_own_checkout(tmp_path):
    """With _harness imported, elastic_vllm (and its kernels) come from the script's checkout, even when run from
    elsewhere without PYTHONPATH (an installed elastic-vllm of another checkout comes after it on sys.path)."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import _harness, elastic_vllm.ops.prefill.kernel as k\n"
        "print(k.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "elastic_vllm" / "ops" / "prefill" / "kernel.py"


def test_run_record_names_the_commit_given_by_the_device_caller(monkeypatch):
    from _harness import environment

    monkeypatch.setenv("GIT_COMMIT", "feedbeef")
    env = environment(("torch", "no_such_module_here"), argv=["python3", "benchmarks/x.py", "--out", "a b.json"])
    assert env["git_commit"] == "feedbeef" and env["git_commit_from"] == "GIT_COMMIT" and env["git_dirty"] is None
    assert env["command"] == "python3 benchmarks/x.py --out 'a b.json'"
    assert env["torch"] and env["gpu"] and env["no_such_module_here"].startswith("unavailable (")
    assert len(env["ops_sha256"]) == 64


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
