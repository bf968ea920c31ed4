#!/usr/bin/env bash
# A serving regression bisected on the GPU: the llama-elastic server of other commits, each with its own
# benchmarks/serve_bench.py, in one device call after staging (same clocks as the current tree's run).
#
#   bash tools/serve_ab.sh prep REF...   # here: .abtest/trees/<sha>/ (the package with its kernels, benchmarks/*.py, setup)
#   bash tools/serve_ab.sh run           # device (carry [".abtest"]): each tree's llama-elastic on WORKLOADS
#                                        # (default 1k); OUT/serve-<sha>.json and .md
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:?prep or run}" in
  prep)
    shift
    rm -rf .abtest/trees && mkdir -p .abtest/trees
    for ref in "$@"; do
      sha=$(git rev-parse --short --verify "$ref^{commit}")
      mkdir -p ".abtest/trees/$sha"
      # the whole tree (an older serve_bench imports tests/gpu/_gpu_common.py; setup.py reads README.md) but the
      # results, data and router weights (~12 MB): the llama server's router is made by serve_bench itself
      git archive "$sha" | tar -x -C ".abtest/trees/$sha" --exclude 'benchmarks/results' --exclude 'benchmarks/data' --exclude 'elastic_vllm/eval/data' \
        --exclude 'router_weights' --exclude 'docs'
      echo ".abtest/trees/$sha"
    done
    du -sh .abtest ;;
  run)
    OUT=${OUT:-/tmp/out}
    # an older wrapper may call a `vllm` script; the staged vLLM lives on PYTHONPATH and has none
    mkdir -p /tmp/ab-bin
    printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/ab-bin/vllm && chmod +x /tmp/ab-bin/vllm
    M=$(PYTHONPATH=/tmp/vsite:/tmp/gsite:$PWD python3 -c "from elastic_vllm.models import fetch_demo_model; \
      print(fetch_demo_model(gguf='/tmp/stage/extra/SmolLM2-135M-Instruct.Q4_1.gguf', quiet=True))")
    rm -rf /tmp/serve-bench-*  # the raw copies below are this tree's only
    for t in .abtest/trees/*/; do
      sha=$(basename "$t")
      (
        cd "$t"
        export PATH=/tmp/ab-bin:$PATH PYTHONPATH=/tmp/vsite:/tmp/gsite:$PWD GIT_COMMIT=$sha
        export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 ELASTIC_VLLM_CACHE=/tmp/evc
        python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip-ab.log 2>&1 \
          || { tail /tmp/pip-ab.log; exit 1; }
        budget=()
        grep -q -- '--budget' benchmarks/serve_bench.py && budget=(--budget 500)
        python3 benchmarks/serve_bench.py --demo-model "$M" --servers llama-elastic --workloads "${WORKLOADS:-1k}" \
          --out "$OUT/serve-$sha.json" "${budget[@]}" 2>&1 | tail -15
      ) || echo "tree $sha: failed"
      # the client's own JSON per burst, kept even where an older report step fails without a baseline
      mkdir -p "$OUT/raw-$sha" && cp /tmp/serve-bench-*/llama-elastic-*.json "$OUT/raw-$sha/" 2>/dev/null || true
      rm -rf /tmp/serve-bench-*
    done
    # the current tree's package again for any later step of this call
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip-ab.log 2>&1 || true ;;
  *) echo "usage: serve_ab.sh prep REF... | run" >&2; exit 2 ;;
esac
