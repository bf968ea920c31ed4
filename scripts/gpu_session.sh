#!/usr/bin/env bash
# One GPU session on the lent H200 (no network): stage vLLM 0.26, then run the checks, training and
# benchmarks. Each step is one `device run` call, back to back (the machine keeps /tmp ~30 s idle).
#   bash scripts/gpu_session.sh stage N     # N = 1..4: copy .vllm-gpu/cN (built by build-bundle.sh) to /tmp/stage;
#                                           # .gpu-carry (router data) when carried (with c4: 64 MiB), 2 installs .whl/gguf
#   bash scripts/gpu_session.sh unpack      # unpack vLLM to /tmp/vsite, convert the demo model (from the carried GGUF)
#   bash scripts/gpu_session.sh check_train # check_vllm.py (P4) and router training (P3) side by side
#   bash scripts/gpu_session.sh e2e         # benchmarks/e2e_vllm.py (P7)
#   bash scripts/gpu_session.sh eval        # benchmarks/accuracy.py (P6) with the router trained in check_train
#   bash scripts/gpu_session.sh kernels     # tests/gpu/check_kernels.py + benchmarks/kernels.py (P2)
# Results go to $OUT; GIT_COMMIT must be set by the caller (the device gets the tree without .git).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 ELASTIC_VLLM_CACHE=/tmp/evc
export PYTHONPATH=/tmp/vsite:/tmp/gsite:$PWD
GGUF=/tmp/stage/extra/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/out}
demo() { python3 -c "from elastic_vllm.models import fetch_demo_model; print(fetch_demo_model(gguf='$GGUF', quiet=True))"; }
step=${1:?step}
case "$step" in
  stage)
    n=${2:?part}
    mkdir -p /tmp/stage && cp .vllm-gpu/c"$n"/* /tmp/stage/
    [ -d .gpu-carry ] && rm -rf /tmp/gpucarry && cp -r .gpu-carry /tmp/gpucarry
    [ "$n" = 2 ] && python3 -m pip install -q --no-index --no-deps --target /tmp/gsite .whl/gguf-*.whl
    ls /tmp/stage; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader ;;
  unpack)
    bash /tmp/stage/unpack.sh
    demo ;;
  train_only)
    # router training alone, without vLLM: the GGUF travels in two halves (.gpu-gguf/a then .gpu-gguf/b,
    # `split -n 2 -d GGUF`), reassembled here; back: the 7 files of gpu_train_smollm2.sh
    [ -d .gpu-carry ] && rm -rf /tmp/gpucarry && cp -r .gpu-carry /tmp/gpucarry
    mkdir -p /tmp/gg && cp .gpu-gguf/*/gg.* /tmp/gg/ 2>/dev/null || true
    if [ "${2:-}" != run ]; then ls -la /tmp/gg; exit 0; fi
    mkdir -p /tmp/stage/extra && cat /tmp/gg/gg.00 /tmp/gg/gg.01 > "$GGUF"
    PYTHONPATH=$PWD MEASURE=1 bash scripts/gpu_train_smollm2.sh "$GGUF" /tmp/gpucarry/router-data "$OUT" ;;
  check_train)
    # two training recipes side by side (VARIANT_A / VARIANT_B: environment for gpu_train_smollm2.sh), both
    # measured; the better router (scripts/pick_router.py) goes to /tmp/router for the eval and e2e steps.
    # Back: trainA.tgz, trainB.tgz (each run's 7 files), trainA.log, trainB.log, check_vllm.json, pick.txt
    M=$(demo)
    for v in A B; do
      eval "vars=\${VARIANT_$v:-}"
      (env $vars STEPS=${STEPS:-600} TIME_BUDGET_S=${TIME_BUDGET_S:-170} MEASURE=1 NEEDLE_PER_LENGTH=${NEEDLE_PER_LENGTH:-10} \
        WORK=/tmp/work$v bash scripts/gpu_train_smollm2.sh "$GGUF" /tmp/gpucarry/router-data /tmp/train$v > "$OUT/train$v.log" 2>&1;
        echo "train rc=$? ($vars)" >> "$OUT/train$v.log"; tar -C /tmp -czf "$OUT/train$v.tgz" train$v) &
    done
    sleep ${CHECK_DELAY:-0}
    timeout ${CHECK_TIMEOUT:-420} python3 tests/gpu/check_vllm.py --model "$M" --out "$OUT/check_vllm.json" \
      --checks ${CHECKS:-all_fa,graphs,needle,batch,long} 2>&1 | grep -vE "^(INFO|DEBUG|\(EngineCore)" | tail -40 || true
    wait; tail -12 "$OUT/trainA.log" "$OUT/trainB.log"
    rm -rf /tmp/router; python3 scripts/pick_router.py /tmp/router /tmp/trainA /tmp/trainB | tee "$OUT/pick.txt" ;;
  e2e)
    M=$(demo)
    R=""; [ -d /tmp/router ] && R="--demo-router /tmp/router"
    python3 benchmarks/e2e_vllm.py --out "$OUT/e2e.json" --demo-model "$M" $R --budget ${BUDGET:-400} 2>&1 | tail -40 ;;
  eval)
    M=$(demo)
    python3 benchmarks/accuracy.py --model "$M" --router /tmp/router --lengths 4096 8192 --samples ${SAMPLES:-20} \
      --out "$OUT/accuracy" --device cuda --time-budget ${BUDGET:-300} 2>&1 | tail -40 ;;
  kernels)
    timeout ${CHECK_TIMEOUT:-200} python3 tests/gpu/check_kernels.py --out "$OUT/check_kernels.json" 2>&1 | tail -40 || true
    python3 benchmarks/kernels.py --out "$OUT/kernels.json" --budget ${BUDGET:-200} 2>&1 | tail -45 ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
