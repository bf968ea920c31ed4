"""The kernel A/B of one device call (tools/ab_prep.sh + tools/gpu_session.sh ab), run here as a plumbing
check under the Triton interpreter: each side times its own kernels (elastic_vllm/ops/), and the result files say
which (the sources' hash and the commit)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tree_hash(ops: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(ops.rglob("*.py")):
        h.update(f.relative_to(ops).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def git(*a: str) -> str:
    return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_ab_prep_exports_the_kernels_of_a_commit(tmp_path):
    dest = tmp_path / "ab"
    r = subprocess.run(["bash", "tools/ab_prep.sh", "HEAD", str(dest)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (dest / "REF").read_text().strip() == git("rev-parse", "--short", "HEAD")
    files = sorted(p.relative_to(dest / "ops").as_posix() for p in (dest / "ops").rglob("*") if p.is_file())
    tracked = git("ls-tree", "-r", "--name-only", "HEAD", "elastic_vllm/ops/").replace("elastic_vllm/ops/", "").split()
    assert files == sorted(tracked)
    kernel = (dest / "ops" / "prefill" / "kernel.py").read_text()
    assert kernel == git("show", "HEAD:elastic_vllm/ops/prefill/kernel.py") + "\n"
    bad = subprocess.run(
        ["bash", "tools/ab_prep.sh", "no-such-ref", str(dest)], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode != 0


@pytest.mark.slow
def test_ab_step_times_each_side_with_its_own_kernels(tmp_path):
    ab, out = tmp_path / "ab", tmp_path / "out"
    subprocess.run(["bash", "tools/ab_prep.sh", "HEAD", str(ab)], cwd=ROOT, check=True, capture_output=True)
    with open(ab / "ops" / "prefill" / "kernel.py", "a") as f:  # the "other commit": same kernels, different sources
        f.write("\n# ab side marker\n")
    env = {**os.environ, "AB_DIR": str(ab), "OUT": str(out), "GIT_COMMIT": "tree0000", "KERNELS_ARGS": "--cpu-dry --quick",
           "SECTIONS": "prefill S="}  # fmt: skip
    r = subprocess.run(["bash", "tools/gpu_session.sh", "ab"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    tree, ref = (json.loads((out / f"kernels-{s}.json").read_text()) for s in ("tree", "ref"))
    assert tree["env"]["ops_sha256"] == tree_hash(ROOT / "elastic_vllm" / "ops")
    assert ref["env"]["ops_sha256"] == tree_hash(ab / "ops") != tree["env"]["ops_sha256"]
    assert tree["env"]["git_commit"] == "tree0000" and ref["env"]["git_commit"] == (ab / "REF").read_text().strip()
    for d in (tree, ref):
        rows = [r for r in d["prefill"] if r["method"] == "ours"]
        assert {r["share"] for r in rows} == {0.0, 0.75} and all(r["ms"] > 0 for r in rows)
        assert not d.get("errors"), d.get("errors")
    # without a prepared side the step says what to do
    env["AB_DIR"] = str(tmp_path / "missing")
    r = subprocess.run(["bash", "tools/gpu_session.sh", "ab"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "ab_prep.sh" in r.stdout
