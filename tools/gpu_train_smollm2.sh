#!/usr/bin/env bash
# Train the Attention Router of SmolLM2-135M-Instruct on one GPU with no network, then (MEASURE=1) measure it.
#
#   bash tools/gpu_train_smollm2.sh GGUF DATA_DIR OUT_DIR [extra train-router args]
#
#   GGUF      SmolLM2-135M-Instruct.Q4_1.gguf (sha256-checked, converted by elastic_vllm.models.fetch_demo_model)
#   DATA_DIR  the output of `elastic-vllm build-data` (train.jsonl.gz, eval.jsonl.gz, manifest.json);
#             built on the CPU machine (sources need the network), carried here
#   OUT_DIR   gets exactly 7 files, flat: router.safetensors, router.json (the router checkpoint, MLP
#             weights stored in float16 as shipped; load it from OUT_DIR itself; measured as stored), summary.json, train_log.jsonl, curves.png, and (MEASURE=1) measure.json,
#             measure.md; the full run (checkpoints, all plots) stays in $WORK
#
# Environment: STEPS (600: planned steps; after 6 steps they shrink, and the LR/tau schedules with them,
# to fit TIME_BUDGET_S), BATCH (16 sequences/step), TIME_BUDGET_S (165 s from the trainer's start: model
# load + tokenizing ~15 s, the rest training; it stops early as a last resort, still writing the router),
# MAX_TOKENS (4096: longer samples are skipped), MICROBATCH_TOKENS (32768 padded tokens per forward),
# ROUTER_LR (2e-3), LAMBDA_LR (0.05), WARMUP (0.05), TARGET_ROBUST (1.0), TARGET_SENSITIVE (0.3),
# DATA_VERSION (unset; 4: fail unless DATA_DIR/manifest.json says builder_version 4, the balanced mixture),
# RANK_PROMPTS (8: calibration prompts per length for the fail-safe floor's ranking; they need RULER's generator,
# nvidia-long-context-eval, which the GPU image lacks: 0 there, then `elastic-vllm router-rank` on a CPU),
# MEASURE (0), NEEDLE_PER_LENGTH (10), NEEDLE_LENGTHS (2048,...,6144), WORK (/tmp/elastic-router-train),
# LAUNCH (python3; e.g. "torchrun --standalone --nproc_per_node 2": FSDP over the GPUs, BATCH split over them).
# The defaults are the SHORT-RUN recipe (a few hundred steps in ~150 s; README.md "Short runs"): a
# higher router LR than the paper's 5e-4, multipliers that bite within ~100 steps (lambda LR 0.05, not
# 1e-3), 5% warmup, sequences <= 4K tokens (the router reads boundary keys; SA still costs LM loss at
# 1K-4K with sink 128 / window 512), and a sensitive target of 0.3 (needle accuracy must stay with
# all-FA's; the paper's 0.7 keeps too few FA heads on this model: its retrieval lives in ~10% of the KV heads).
# Extra arguments go to train-router after these (the last value of a flag wins).
# Wheels the GPU image lacks (pydantic and its deps, gguf) are installed from .whl/ when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${1:?usage: gpu_train_smollm2.sh GGUF DATA_DIR OUT_DIR [train-router args]}
DATA=${2:?missing DATA_DIR}
OUT=${3:?missing OUT_DIR}
shift 3
STEPS=${STEPS:-600}
BATCH=${BATCH:-16}
TIME_BUDGET_S=${TIME_BUDGET_S:-165}
MAX_TOKENS=${MAX_TOKENS:-4096}
MICROBATCH_TOKENS=${MICROBATCH_TOKENS:-32768}
ROUTER_LR=${ROUTER_LR:-2e-3}
LAMBDA_LR=${LAMBDA_LR:-0.05}
WARMUP=${WARMUP:-0.05}
TARGET_ROBUST=${TARGET_ROBUST:-1.0}
TARGET_SENSITIVE=${TARGET_SENSITIVE:-0.3}
WORK=${WORK:-/tmp/elastic-router-train}
T0=$(date +%s)
if [ -n "${DATA_VERSION:-}" ]; then  # a router trained on the wrong mixture would look like a result
  got=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['builder_version'])" "$DATA/manifest.json")
  [ "$got" = "$DATA_VERSION" ] || { echo "DATA_VERSION=$DATA_VERSION but $DATA/manifest.json has builder_version $got" >&2; exit 2; }
fi
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
# SmolLM2 at <= 8K: sink 128 + window 512 (at 4K-8K, window 256 lost about twice as much needle accuracy as 512); the backbone has
# memory to spare on an H200, so no activation checkpointing (one recompute pass less)
set -o pipefail
${LAUNCH:-python3} -m elastic_vllm.cli train-router \
  --model "$MODEL" --data "$DATA/train.jsonl.gz" --out "$WORK" \
  --sink 128 --window 512 --steps "$STEPS" --batch-size "$BATCH" --max-tokens "$MAX_TOKENS" \
  --microbatch-tokens "$MICROBATCH_TOKENS" --router-lr "$ROUTER_LR" --lambda-lr "$LAMBDA_LR" --warmup "$WARMUP" \
  --target-robust "$TARGET_ROBUST" --target-sensitive "$TARGET_SENSITIVE" \
  --no-gradient-checkpointing --no-progress --backbone-id HuggingFaceTB/SmolLM2-135M-Instruct \
  --rank-prompts "${RANK_PROMPTS:-8}" --time-budget-s "$TIME_BUDGET_S" "$@" 2>&1 | { grep -v "Loading weights" || true; }

cp "$WORK/summary.json" "$WORK/train_log.jsonl" "$OUT/"
# the router as it ships: MLP weights stored in float16 (input standardization float32); measured below
python3 -c "
import sys, torch
from elastic_vllm.router.checkpoint import load_router, save_router
ck = load_router(sys.argv[1]); save_router(ck.router, sys.argv[2], ck.meta, weights_dtype=torch.float16)
" "$WORK/router" "$OUT"
[ -f "$WORK/plots/curves.png" ] && cp "$WORK/plots/curves.png" "$OUT/"
echo "trained in $(( $(date +%s) - T0 )) s total"
python3 - "$WORK/summary.json" "$WORK/train_log.jsonl" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({k: s.get(k) for k in ("steps", "steps_planned", "steps_fitted_to_time_budget", "stopped_early_at_step",
                                        "wall_s", "device", "omega_msr_by_category", "final_window", "lambdas")}, indent=1))
log = [json.loads(ln) for ln in open(sys.argv[2]) if ln.strip()]
st = sorted(r["step_s"] for r in log[2:]) or [0.0]
print(f"step time: median {st[len(st) // 2]:.3f} s, max {st[-1]:.3f} s over {len(log)} steps "
      f"({sum(r['tokens'] for r in log) / max(1, len(log)):.0f} tokens/step)")
for r in log[:: max(1, len(log) // 12)] + log[-1:]:
    print(r["step"], f"lm {r['lm_loss']:.3f}", "argmax Omega", {t: round(v, 2) for t, v in r["omega_argmax"].items()},
          "lambda1", {c: round(v["lambda1"], 3) for c, v in r["lambdas"].items()})
PY

if [ "${MEASURE:-0}" = 1 ]; then
  python3 scripts/measure_trained_router.py --model "$MODEL" --router "$OUT" --eval "$DATA/eval.jsonl.gz" \
    --per-length "${NEEDLE_PER_LENGTH:-10}" --lengths "${NEEDLE_LENGTHS:-2048,3072,4096,5120,6144}" --out "$OUT/measure.json" | tee "$OUT/measure.md"
  echo "measured in $(( $(date +%s) - T0 )) s total"
fi
ls "$OUT"
