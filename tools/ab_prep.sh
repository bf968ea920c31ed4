#!/usr/bin/env bash
# Prepare an A/B of the kernels on the GPU: the csrc/ of another commit, for `tools/gpu_session.sh ab`
# (which times this tree and that csrc/ in one device call, so both see the same GPU state).
#
#   bash tools/ab_prep.sh REF [DEST]   # DEST (default .abtest, git-ignored): DEST/csrc/*.py of REF, DEST/REF
#
# then, in the device call: carry [".abtest"], command `SECTIONS="tune,prefill S=32768 d=128" bash
# tools/gpu_session.sh ab` (GIT_COMMIT set to this tree's commit, as for every device run).
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: ab_prep.sh REF [DEST]}
dest=${2:-.abtest}
sha=$(git rev-parse --short --verify "$ref^{commit}")
rm -rf "$dest"
mkdir -p "$dest"
git archive "$sha" csrc | tar -x -C "$dest"
echo "$sha" > "$dest/REF"
echo "$dest: csrc/ of $sha ($(ls "$dest/csrc" | wc -l) files)"
