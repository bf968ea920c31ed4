#!/usr/bin/env bash
# Train the Attention Router of SmolLM2-135M-Instruct on one GPU with no network, then (MEASURE=1) measure it.
#
#   bash scripts/gpu_train_smollm2.sh GGUF DATA_DIR OUT_DIR [extra train-router args]
#
#   GGUF      SmolLM2-135M-Instruct.Q4_1.gguf (sha256-checked, converted by elastic_vllm.models.fetch_demo_model)
#   DATA_DIR  the output of `elastic-vllm build-data` (train.jsonl.gz, eval.jsonl.gz, manifest.json);
#             built on the CPU machine (sources need the network), carried here
#   OUT_DIR   gets <= 8 files: router/router.safetensors, router/router.json, summary.json, train_log.jsonl,
#             curves.png, train.out, measure.json + measure.md (MEASURE=1); the full run stays in $WORK
#
# Environment: STEPS (300), BATCH (8 sequences/step), TIME_BUDGET_S (300 s from the trainer's start: after
# 6 steps the planned steps, and with them the LR/tau schedules, shrink to fit it if needed; it stops early
# as a last resort, still writing the router), MEASURE (0), NEEDLE_PER_LENGTH (20),
# WORK (/tmp/elastic-router-train). Budget: ~6 minutes on one H200 for the training part.
# Extra arguments go to train-router, e.g. `--target-sensitive 0.5 --router-lr 1e-3` (defaults: the paper's).
# Wheels the GPU image lacks (pydantic and its deps, gguf) are installed from .whl/ when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${1:?usage: gpu_train_smollm2.sh GGUF DATA_DIR OUT_DIR [train-router args]}
DATA=${2:?missing DATA_DIR}
OUT=${3:?missing OUT_DIR}
shift 3
STEPS=${STEPS:-300}
BATCH=${BATCH:-8}
TIME_BUDGET_S=${TIME_BUDGET_S:-300}
WORK=${WORK:-/tmp/elastic-router-train}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

need=()
python3 -c "import pydantic" 2>/dev/null || need+=(pydantic pydantic_core annotated_types typing_inspection typing_extensions)
python3 -c "import gguf" 2>/dev/null || need+=(gguf)
if [ ${#need[@]} -gt 0 ]; then
  files=()
  for n in "${need[@]}"; do files+=(.whl/"${n}"-*.whl); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/elastic-site "${files[@]}"
  export PYTHONPATH=/tmp/elastic-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"

MODEL=$(python3 -c "from elastic_vllm.models import fetch_demo_model; print(fetch_demo_model(gguf='$GGUF', quiet=True))")
echo "model: $MODEL ($(( $(date +%s) - T0 )) s)"

mkdir -p "$WORK" "$OUT"
# SmolLM2 at <= 8K: sink 128 + window 512 (MODELS_AND_DATA.md: W >= 512 at 4K-8K); the backbone has
# memory to spare on an H200, so no activation checkpointing (one recompute pass less)
set -o pipefail
python3 -m elastic_vllm.cli train-router \
  --model "$MODEL" --data "$DATA/train.jsonl.gz" --out "$WORK" \
  --sink 128 --window 512 --steps "$STEPS" --batch-size "$BATCH" --max-tokens 8192 \
  --no-gradient-checkpointing --backbone-id HuggingFaceTB/SmolLM2-135M-Instruct \
  --time-budget-s "$TIME_BUDGET_S" "$@" 2>&1 | tee "$OUT/train.out"

mkdir -p "$OUT/router"
cp "$WORK/router/router.safetensors" "$WORK/router/router.json" "$OUT/router/"
cp "$WORK/summary.json" "$WORK/train_log.jsonl" "$OUT/"
[ -f "$WORK/plots/curves.png" ] && cp "$WORK/plots/curves.png" "$OUT/"
echo "trained in $(( $(date +%s) - T0 )) s total"
python3 - "$WORK/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({k: s.get(k) for k in ("steps", "steps_planned", "stopped_early_at_step", "wall_s", "device",
                                        "omega_msr_by_category", "final_window", "lambdas")}, indent=1))
PY

if [ "${MEASURE:-0}" = 1 ]; then
  python3 scripts/measure_trained_router.py --model "$MODEL" --router "$OUT/router" --eval "$DATA/eval.jsonl.gz" \
    --per-length "${NEEDLE_PER_LENGTH:-20}" --out "$OUT/measure.json" | tee "$OUT/measure.md"
  echo "measured in $(( $(date +%s) - T0 )) s total"
fi
