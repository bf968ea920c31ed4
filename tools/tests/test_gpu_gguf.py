"""tools/gpu_gguf.sh + gpu_session.sh gguf_part / eval_gguf: the demo model's GGUF in pieces that each travel
with the tree in one device call (64 MiB per call), put back together byte for byte on the other side."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALL_LIMIT = 64 * 2**20
REAL_GGUF_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf (elastic_vllm.models checks its sha256)
WHEELS_BYTES = 3 * 2**20  # pydantic + pydantic-core + annotated-types + typing-inspection: 2.6 MB


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def test_pieces_rebuild_the_gguf_and_each_fits_one_call(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(3 * 2**20 + 17))
    dest = tmp_path / "carry"
    env = {**os.environ, "GGUF_FILE": str(src), "NO_WHEELS": "1"}
    r = subprocess.run(["bash", "tools/gpu_gguf.sh", str(dest)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pieces = [dest / f"p{i}" / f"gg.0{i - 1}" for i in (1, 2, 3)]
    assert b"".join(p.read_bytes() for p in pieces) == src.read_bytes()
    # the real GGUF's biggest piece, the wheels and the tree fit one call, with room for the tree to grow
    assert REAL_GGUF_BYTES // 3 + 1 + WHEELS_BYTES + tracked_bytes() < CALL_LIMIT - 8 * 2**20
    missing = subprocess.run(["bash", "tools/gpu_gguf.sh", str(dest)], cwd=ROOT,
                             env={**env, "GGUF_FILE": str(tmp_path / "nope.gguf")}, capture_output=True, text=True)  # fmt: skip
    assert missing.returncode != 0 and "no GGUF" in missing.stderr

    # the device side: each call's piece lands in GG_DIR (gguf_part for the eval, train_only for router training:
    # one collection step), then eval_gguf joins them (GGUF_ONLY: no conversion)
    work = tmp_path / "tree"
    (work / "tools").mkdir(parents=True)
    (work / "tools" / "gpu_session.sh").write_bytes((ROOT / "tools" / "gpu_session.sh").read_bytes())
    for step in ("gguf_part", "train_only"):
        gg, joined = tmp_path / f"gg-{step}", tmp_path / f"stage-{step}" / "model.gguf"
        denv = {**os.environ, "GG_DIR": str(gg), "GGUF": str(joined), "GGUF_ONLY": "1", "OUT": str(tmp_path / "out")}
        for p in pieces:  # one call per piece: only that piece travels
            carried = work / ".gpu-gguf"
            subprocess.run(["rm", "-rf", str(carried)], check=True)
            (carried / p.parent.name).mkdir(parents=True)
            (carried / p.parent.name / p.name).write_bytes(p.read_bytes())
            r = subprocess.run(["bash", "tools/gpu_session.sh", step], cwd=work, env=denv, capture_output=True,
                               text=True)  # fmt: skip
            assert r.returncode == 0, r.stderr
        r = subprocess.run(
            ["bash", "tools/gpu_session.sh", "eval_gguf"], cwd=work, env=denv, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        assert joined.read_bytes() == src.read_bytes(), step
        assert hashlib.sha256(src.read_bytes()).hexdigest() in r.stdout
