#!/usr/bin/env bash
# Prepare an A/B of the kernels on the GPU: the kernels (elastic_vllm/ops/) of another commit, for
# `tools/gpu_session.sh ab` (which times this tree and those kernels in one device call, so both see the same GPU
# state). REF must have elastic_vllm/ops/ (the layout the benchmarks of this tree import).
#
#   bash tools/ab_prep.sh REF [DEST]   # DEST (default .abtest, git-ignored): DEST/ops/ of REF, DEST/REF
#
# then, in the device call: carry [".abtest"], command `SECTIONS="prefill S=32768 d=128" bash
# tools/gpu_session.sh ab` (GIT_COMMIT set to this tree's commit, as for every device run).
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: ab_prep.sh REF [DEST]}
dest=${2:-.abtest}
sha=$(git rev-parse --short --verify "$ref^{commit}")
git cat-file -e "$sha:elastic_vllm/ops" 2>/dev/null \
  || { echo "$ref ($sha) has no elastic_vllm/ops/: its kernels predate the layout this tree's benchmarks import" >&2; exit 2; }
rm -rf "$dest"
mkdir -p "$dest"
git archive "$sha" elastic_vllm/ops | tar -x -C "$dest"
mv "$dest/elastic_vllm/ops" "$dest/ops" && rmdir "$dest/elastic_vllm"
echo "$sha" > "$dest/REF"
echo "$dest: elastic_vllm/ops/ of $sha ($(find "$dest/ops" -name '*.py' | wc -l) files)"
