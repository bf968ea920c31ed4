#!/usr/bin/env bash
# One GPU session on the lent H200 (no network): stage vLLM 0.26, then run the checks, training and
# benchmarks. Each step is one `device run` call, back to back (the machine keeps /tmp ~30 s idle).
#   bash tools/gpu_session.sh stage N     # N = 1..: copy .vllm-gpu/cN (built by tools/gpu_bundle.sh: parts that fit
#                                           # one call with the tree) to /tmp/stage; .gpu-carry (router data) when
#                                           # carried (mind the 64 MiB per call), 2 installs .whl/gguf
#   bash tools/gpu_session.sh unpack      # unpack vLLM to /tmp/vsite, convert the demo model (from the carried GGUF)
#   bash tools/gpu_session.sh check_train # tests/gpu/test_gpu_vllm.py and router training side by side
#   bash tools/gpu_session.sh e2e         # benchmarks/e2e_vllm.py (P7): E2E_JOBS, the jobs that fit this call
#   bash tools/gpu_session.sh eval        # benchmarks/accuracy.py (P6) with the router trained in check_train
#   bash tools/gpu_session.sh gguf_part   # no vLLM: the eval's model in pieces (tools/gpu_gguf.sh builds
#   bash tools/gpu_session.sh eval_gguf   # .gpu-gguf/p1..p3), one call per piece (carry .gpu-gguf/pN), the last
#                                           # with eval_gguf (carry .gpu-gguf/p3 .whl): ~2 min less than staging vLLM
#   bash tools/gpu_session.sh generalization  # eval --suite generalization-split (held-out families of the split) of ROUTERS
#                                           # (space-separated folders, run side by side on the GPU), MARGINS
#   bash tools/gpu_session.sh kernels     # tests/gpu/test_gpu_kernels.py + benchmarks/kernels.py; SECTIONS / QUICK
#   bash tools/gpu_session.sh tune        # tools/tune_kernels.py: prefill tiles, decode splits and tiles; SECTIONS
#   bash tools/gpu_session.sh fa_split    # benchmarks/fa_split.py: hybrid prompt steps, fused kernel vs FA heads on
#                                           # vLLM's FA3 (after staging); FA_SPLIT_SHAPES, FA_SPLIT_SHARES
#   bash tools/gpu_session.sh serve       # benchmarks/serve_bench.py: SERVERS, WORKLOADS, SB_MML, MERGE, SB_NAME
#   bash tools/gpu_session.sh ab          # kernels.py on this tree and on another commit's kernels (tools/ab_prep.sh)
#   bash tools/gpu_session.sh budgets     # eval --suite budgets (= elastic-vllm eval) of the demo model and ROUTER
#                                           # (default: the shipped one): score vs realized Omega_MSR; SAMPLES, BUDGET
#   bash tools/gpu_session.sh ramp        # benchmarks/load_ramp.py (P15): load policy off vs on, request-rate steps
#                                           # past saturation, the live elastic:load_bias; RAMP_* (see the step)
# One GPU, after staging: TRAIN_GPU=0 TRAIN_SITE=/tmp/vsite train_bg (the staged GGUF; carry .whl), then check /
# kernels while it trains, collect_train, generalization; the timed `serve` last, alone on the GPU.
# Two-GPU machine (nvidia-h200-x2), trainers in the background while vLLM is staged and checked:
#   train_only per GGUF piece but the last (carry .gpu-gguf/p1 .gpu-carry .whl, then p2), then `train_bg` (carry the
#   last piece, .gpu-gguf/p3, and .whl; pieces from tools/gpu_gguf.sh): recipes
#   VARIANT_A / VARIANT_B start detached on GPU $TRAIN_GPU from a copy of the tree (/tmp/tree-train);
#   stage 1..N + unpack; check (CHECKS on GPU 0); collect_train (waits, tars, picks /tmp/router);
#   fsdp (torchrun over both GPUs with VARIANT_A's recipe and step count, compared with run A) + tp
#   (tests/gpu/test_gpu_tp.py); eval_bg (accuracy on GPU 1, detached) + e2e; collect_eval.
# Results go to $OUT; GIT_COMMIT must be set by the caller (the device gets the tree without .git).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 ELASTIC_VLLM_CACHE=/tmp/evc
# the lent multi-GPU machines' policy: NVLink multicast stays off
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# tools/device_site (a pydantic stand-in for the image, which has none) last: a staged vLLM's real one comes first
export PYTHONPATH=/tmp/vsite:/tmp/gsite:$PWD:$PWD/tools/device_site
GGUF=${GGUF:-/tmp/stage/extra/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/out}
GG=${GG_DIR:-/tmp/gg}  # the GGUF's pieces (tools/gpu_gguf.sh) gathered over several calls
# the router data the training steps read: .gpu-carry/router-data, or with DATA_VERSION=4 .gpu-carry/router-data-v4
# (`elastic-vllm build-data --version 4`, the balanced mixture; gpu_train_smollm2.sh checks its manifest's version)
RDATA=/tmp/gpucarry/router-data${DATA_VERSION:+-v$DATA_VERSION}
gguf_collect() {  # this call's pieces of .gpu-gguf/* to $GG; a piece's wheels (whl/) to /tmp/gsite
  mkdir -p "$GG"
  for d in .gpu-gguf/*/; do
    [ -d "$d" ] || continue
    cp "$d"gg.* "$GG/"
    if [ -d "${d}whl" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gsite "${d}"whl/*.whl; fi
  done
}
gguf_join() { mkdir -p "$(dirname "$GGUF")" && cat "$GG"/gg.* > "$GGUF"; }  # pieces in name order
# the GPU tests (pytest, gpu-marked), their rows to a JSON file, within a time limit: gpu_tests SECONDS FILE JSON
# [pytest args...]. --confcutdir: tests/gpu/conftest.py only, not tests/conftest.py (the CPU tests' interpreter default
# and their installs check, which this image does not pass)
gpu_tests() {
  local t=$1 f=$2 json=$3; shift 3
  TRITON_INTERPRET=0 timeout "$t" python3 -m pytest -p no:cacheprovider --confcutdir tests/gpu -q -rfEs "tests/gpu/$f" \
    --gpu-out "$json" "$@" \
    2>&1 | grep -vE "^(INFO|DEBUG|WARNING|\(EngineCore|\(Worker)" | tail -40 || true
}
# the vLLM tests named in CHECKS (comma list), one process each (a second engine in one process broke CUDA graph
# capture), the rows joined in one JSON, within SECONDS for all: vllm_tests SECONDS JSON
vllm_tests() {
  local end=$((SECONDS + $1)) json=$2 c
  rm -f "$json"
  for c in ${CHECKS//,/ }; do
    [ $SECONDS -lt "$end" ] || { echo "time limit: $c not run"; continue; }
    gpu_tests $((end - SECONDS)) test_gpu_vllm.py "$json" --gpu-append -k "$c" --model "$M"
  done
}
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
  gguf_part)
    # eval without vLLM (tools/gpu_gguf.sh builds .gpu-gguf/p1..pN): the carried part's piece of the GGUF to
    # $GG_DIR, its wheels (pydantic, in p1) to /tmp/gsite
    gguf_collect
    ls -l "$GG" ;;
  eval_gguf)
    # the GGUF whole again from every piece, then the `eval` step (it converts the model)
    gguf_join
    [ -n "${GGUF_ONLY:-}" ] && { sha256sum "$GGUF"; exit 0; }
    python3 -m pip install -q --no-index --no-deps --target /tmp/gsite .whl/gguf-*.whl
    : "${ROUTER:?ROUTER: a router folder}"
    exec bash "$0" eval ;;
  train_only)
    # router training alone, without vLLM: the GGUF travels in pieces (tools/gpu_gguf.sh), one call each
    # (`train_only`), the last with `train_only run`; back: the 7 files of gpu_train_smollm2.sh
    [ -d .gpu-carry ] && rm -rf /tmp/gpucarry && cp -r .gpu-carry /tmp/gpucarry
    gguf_collect
    if [ "${2:-}" != run ]; then ls -la "$GG"; exit 0; fi
    gguf_join
    PYTHONPATH=$PWD MEASURE=1 bash tools/gpu_train_smollm2.sh "$GGUF" "$RDATA" "$OUT" ;;
  train_bg)
    # the GGUF's last piece arrives now (or vLLM's staging brought it); the recipes start detached (they
    # outlive this call) on one GPU
    [ -f "$GGUF" ] || { gguf_collect; gguf_join; }
    [ -d .gpu-carry ] && rm -rf /tmp/gpucarry && cp -r .gpu-carry /tmp/gpucarry
    rm -rf /tmp/tree-train && mkdir -p /tmp/tree-train && cp -r elastic_vllm scripts tools .whl pyproject.toml /tmp/tree-train/
    # the trainers' own site (pydantic, gguf) and the model converted once, before they start (no races)
    [ -n "${LOCAL_DRY:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/elastic-site .whl/*.whl
    export PYTHONPATH=/tmp/elastic-site${TRAIN_SITE:+:$TRAIN_SITE}:$PWD; M=$(demo); echo "model $M"
    for v in ${VARIANTS:-A B}; do
      eval "vars=\${VARIANT_$v:-}"
      rm -rf /tmp/train$v /tmp/work$v
      # setsid -f: a new session (it outlives this call), the launching subshell returns at once
      (cd /tmp/tree-train && PYTHONPATH=/tmp/elastic-site${TRAIN_SITE:+:$TRAIN_SITE} CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-1} exec setsid -f env $vars \
        MEASURE=1 WORK=/tmp/work$v bash -c "bash tools/gpu_train_smollm2.sh $GGUF $RDATA /tmp/train$v; \
        echo train rc=\$? > /tmp/train$v.rc") > /tmp/train$v.log 2>&1 < /dev/null
      echo "started $v: $vars"
    done
    sleep 20; tail -n 5 /tmp/train*.log; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader ;;
  bg_status)
    for f in /tmp/train*.log /tmp/eval.log; do [ -f "$f" ] && { echo "== $f"; tail -n 4 "$f"; }; done
    ls /tmp/*.rc 2>/dev/null; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader ;;
  check)
    M=$(demo)
    CHECKS=${CHECKS:-all_fa,graphs,needle,batch,long,metrics} CUDA_VISIBLE_DEVICES=${CHECK_GPU:-0} \
      vllm_tests ${CHECK_TIMEOUT:-480} "$OUT/check_vllm.json"
    bash "$0" bg_status ;;
  collect_train)
    # wait for the detached trainers (at most WAIT_S), bring back their files, pick the router
    for _ in $(seq 1 $(( ${WAIT_S:-300} / 5 ))); do
      done_all=1; for v in ${VARIANTS:-A B}; do [ -f /tmp/train$v.rc ] || done_all=0; done
      [ $done_all = 1 ] && break; sleep 5
    done
    for v in ${VARIANTS:-A B}; do
      cat /tmp/train$v.rc 2>/dev/null || echo "train $v: still running"; cp /tmp/train$v.log "$OUT/" || true
      tar -C /tmp -czf "$OUT/train$v.tgz" train$v || true; tail -n 14 /tmp/train$v.log
    done
    rm -rf /tmp/router; python3 tools/pick_router.py /tmp/router $(for v in ${VARIANTS:-A B}; do echo /tmp/train$v; done) | tee "$OUT/pick.txt" ;;
  fsdp)
    # P10: the same recipe as run A (same seed, same steps) under torchrun with FSDP over both GPUs
    steps=$(python3 -c "import json; print(json.load(open('/tmp/trainA/summary.json'))['steps'])")
    rm -rf /tmp/fsdp /tmp/work-fsdp
    env ${VARIANT_A:-} STEPS=$steps TIME_BUDGET_S=${FSDP_BUDGET_S:-400} WORK=/tmp/work-fsdp \
      LAUNCH="torchrun --standalone --nproc_per_node 2" bash tools/gpu_train_smollm2.sh "$GGUF" \
      "$RDATA" /tmp/fsdp > "$OUT/fsdp.log" 2>&1 || echo "fsdp rc=$?" | tee -a "$OUT/fsdp.log"
    tail -n 16 "$OUT/fsdp.log"
    python3 tools/compare_train_runs.py /tmp/trainA /tmp/fsdp --out /tmp/fsdp/compare.json --world-run 2 \
      ${REF_SHARED:+--ref-shared} || true
    tar -C /tmp -czf "$OUT/fsdp.tgz" fsdp ;;
  tp)
    M=$(demo)
    gpu_tests ${TP_TIMEOUT:-360} test_gpu_tp.py "$OUT/check_tp.json" --model "$M" --tp-time-budget ${TP_BUDGET:-320} ;;
  eval_bg)
    M=$(demo)
    rm -rf /tmp/acc /tmp/eval.rc
    (CUDA_VISIBLE_DEVICES=${EVAL_GPU:-1} exec setsid -f bash -c "python3 benchmarks/accuracy.py --model $M --router /tmp/router \
      --lengths ${LENGTHS:-4096 8192} --samples ${SAMPLES:-20} --out /tmp/acc --device cuda --time-budget ${BUDGET:-300} \
      ${METHODS:+--methods $METHODS} ${IMPL:+--impl $IMPL}; \
      echo eval rc=\$? > /tmp/eval.rc") > /tmp/eval.log 2>&1 < /dev/null
    echo "eval started" ;;
  collect_eval)
    for _ in $(seq 1 $(( ${WAIT_S:-300} / 5 ))); do [ -f /tmp/eval.rc ] && break; sleep 5; done
    cat /tmp/eval.rc 2>/dev/null || echo "eval: still running"; tail -n 30 /tmp/eval.log; cp /tmp/eval.log "$OUT/"
    tar -C /tmp -czf "$OUT/accuracy.tgz" acc ;;
  check_train)
    # two training recipes side by side (VARIANT_A / VARIANT_B: environment for gpu_train_smollm2.sh), both
    # measured; the better router (tools/pick_router.py) goes to /tmp/router for the eval and e2e steps.
    # Back: trainA.tgz, trainB.tgz (each run's 7 files), trainA.log, trainB.log, check_vllm.json, pick.txt
    M=$(demo)
    for v in A B; do
      eval "vars=\${VARIANT_$v:-}"
      (env $vars STEPS=${STEPS:-600} TIME_BUDGET_S=${TIME_BUDGET_S:-170} MEASURE=1 NEEDLE_PER_LENGTH=${NEEDLE_PER_LENGTH:-10} \
        WORK=/tmp/work$v bash tools/gpu_train_smollm2.sh "$GGUF" "$RDATA" /tmp/train$v > "$OUT/train$v.log" 2>&1;
        echo "train rc=$? ($vars)" >> "$OUT/train$v.log"; tar -C /tmp -czf "$OUT/train$v.tgz" train$v) &
    done
    sleep ${CHECK_DELAY:-0}
    CHECKS=${CHECKS:-all_fa,graphs,needle,batch,long} vllm_tests ${CHECK_TIMEOUT:-420} "$OUT/check_vllm.json"
    wait; tail -12 "$OUT/trainA.log" "$OUT/trainB.log"
    rm -rf /tmp/router; python3 tools/pick_router.py /tmp/router /tmp/trainA /tmp/trainB | tee "$OUT/pick.txt" ;;
  e2e)
    M=$(demo)
    R=""; [ -d /tmp/router ] && R="--demo-router /tmp/router"
    # the whole plan takes longer than one call: each call runs the jobs named (gpu_plan's names, e.g.
    # llama8b-flash then llama8b-elastic), the files join with `e2e_vllm.py --merge`
    : "${E2E_JOBS:?E2E_JOBS: comma-separated job names of benchmarks/e2e_vllm.py gpu_plan for this call}"
    CUDA_VISIBLE_DEVICES=${E2E_GPU:-0} python3 benchmarks/e2e_vllm.py --out "$OUT/e2e.json" --demo-model "$M" $R \
      --jobs "$E2E_JOBS" ${E2E_KINDS:+--kinds $E2E_KINDS} ${E2E_MIN_PRIO:+--min-prio $E2E_MIN_PRIO} 2>&1 | tail -40
    tar -C "$OUT" -czf "$OUT/e2e_logs.tgz" e2e_logs 2>/dev/null && rm -rf "$OUT/e2e_logs" || true ;;
  eval)
    M=$(demo)
    # ROUTER (default /tmp/router, from check_train), LENGTHS, METHODS, IMPL (torch | triton) as for eval_bg
    python3 benchmarks/accuracy.py --model "$M" --router "${ROUTER:-/tmp/router}" --lengths ${LENGTHS:-4096 8192} \
      --samples ${SAMPLES:-20} --out "$OUT/accuracy" --device cuda --time-budget ${BUDGET:-300} \
      ${METHODS:+--methods $METHODS} ${IMPL:+--impl $IMPL} 2>&1 | grep -v Warning | tail -40 ;;
  serve)
    # benchmarks/serve_bench.py: `vllm serve` + `vllm bench serve`, elastic vs FLASH_ATTN. SERVERS (comma list of
    # llama-base, llama-elastic (whole layers SA), llama-mixed (2 FA + 6 SA heads a layer), llama-mixed50 (4 + 4),
    # llama-elastic-kernels, demo-base, demo-elastic), WORKLOADS (what fits this call), SB_MML (the Llama servers'
    # max_model_len: the same in every call whose rows are compared; default the longest workload's), MERGE
    # (earlier outputs in /tmp/sb to keep), SB_NAME (the output's name), SERVE_TIMEOUT (540 s, then SIGINT: the
    # server stops, the bursts done stay in the output, written after each). The plugin's entry point needs the
    # tree pip-installed.
    M=$(demo)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip-e.log 2>&1 || { tail /tmp/pip-e.log; exit 1; }
    mkdir -p /tmp/sb "$OUT"
    timeout -s INT ${SERVE_TIMEOUT:-540} python3 benchmarks/serve_bench.py --demo-model "$M" --servers "${SERVERS:?}" \
      ${WORKLOADS:+--workloads $WORKLOADS} ${SB_MML:+--max-model-len $SB_MML} --out /tmp/sb/"${SB_NAME:-serve}".json \
      ${MERGE:+--merge $MERGE} 2>&1 | grep -vE "^(INFO|DEBUG|\(EngineCore|\(APIServer)" | tail -60 || true
    cp /tmp/sb/"${SB_NAME:-serve}".json /tmp/sb/"${SB_NAME:-serve}".md "$OUT/" ;;
  fa_split)
    # benchmarks/fa_split.py: one layer's hybrid prompt step (1K-8K prompts, 8 x 1K, the last 8K chunk of 16K-128K
    # contexts) at SA shares 0-1, the fused kernel for every head against the FA heads on vLLM's FA3 (one call per
    # KV head) + the fused kernel for the SA heads; each split output checked against the fused one before it is
    # timed. FA_SPLIT_SHAPES (llama,demo), FA_SPLIT_SHARES, FA_SPLIT_NAME; FA_SPLIT_TIMEOUT (540 s, then SIGINT:
    # the file holds every case done). Back: OUT/<name>.json
    mkdir -p "$OUT"
    timeout -s INT ${FA_SPLIT_TIMEOUT:-540} python3 benchmarks/fa_split.py --out "$OUT/${FA_SPLIT_NAME:-fa-split}.json" \
      ${FA_SPLIT_SHAPES:+--shapes $FA_SPLIT_SHAPES} ${FA_SPLIT_SHARES:+--shares $FA_SPLIT_SHARES} 2>&1 \
      | grep -vE "Warning|^\[" | tail -80 || true ;;
  budgets)
    # `elastic-vllm eval --suite budgets` (its harness through benchmarks/accuracy.py, as the eval steps: runs from the
    # bare tree): accuracy vs realized Omega_MSR at fixed SA budgets, router-ranked vs static vs random heads. ROUTER
    # (default the shipped router), TARGETS (default 0.25 0.5 0.75 0.9), SAMPLES per (family, category), BUDGET: the
    # harness skips the budgets left after that many seconds (2 + 3 x 4 runs of the generalization split: ~8 min at 8)
    M=$(demo)
    python3 benchmarks/accuracy.py --suite budgets --model "$M" --router "${ROUTER:-router_weights/smollm2-135m-instruct}" \
      --out "$OUT/budgets" --device cuda --samples ${SAMPLES:-8} --time-budget ${BUDGET:-480} \
      ${TARGETS:+--targets $TARGETS} 2>&1 | grep -v Warning | tail -40 ;;
  ramp)
    # benchmarks/load_ramp.py: two elastic servers, load_policy off / on, each a burst (the off one's measures the
    # saturating rate) then request-rate steps, prompts input x (1 +- range) tokens. RAMP_MODEL (demo: the shipped
    # router; llama: 8B shape, dummy weights, fixed-share router), RAMP_STEPS (multiples of the saturating rate,
    # default 0.5,1,1.5,2,3), RAMP_SAT (req/s; default measured), RAMP_STEP_S (seconds of arrivals a step, 12),
    # RAMP_BURST (256; llama 32), RAMP_MAX_PROMPTS (3000), RAMP_INPUT / RAMP_RANGE / RAMP_OUTPUT (4096 / 0.9 / 32),
    # RAMP_POLICY (JSON load_policy fields; default the config's), RAMP_SERVERS (off,on: split over calls with
    # RAMP_SAT; the demo's off server alone took 400 s on the H100, llama's take ~3 min each to start: split, then
    # `load_ramp.py --report --merge` pairs the files here), RAMP_NAME, RAMP_TIMEOUT (520 s, then SIGINT: the
    # servers stop, the JSON of the servers done stays). Back: OUT/<name>.json, .md, -bias.png. Takes
    # ~ startup + burst + ~6 x RAMP_STEP_S s a server.
    M=$(demo)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip-e.log 2>&1 || { tail /tmp/pip-e.log; exit 1; }
    mkdir -p /tmp/ramp "$OUT"
    n=${RAMP_NAME:-load-ramp}
    timeout -s INT ${RAMP_TIMEOUT:-520} python3 benchmarks/load_ramp.py --demo-model "$M" --model ${RAMP_MODEL:-demo} \
      --servers ${RAMP_SERVERS:-off,on} ${RAMP_STEPS:+--steps $RAMP_STEPS} ${RAMP_SAT:+--sat-rate $RAMP_SAT} \
      ${RAMP_STEP_S:+--step-s $RAMP_STEP_S} ${RAMP_BURST:+--burst $RAMP_BURST} \
      ${RAMP_MAX_PROMPTS:+--max-prompts $RAMP_MAX_PROMPTS} ${RAMP_INPUT:+--input $RAMP_INPUT} \
      ${RAMP_RANGE:+--range-ratio $RAMP_RANGE} ${RAMP_OUTPUT:+--output $RAMP_OUTPUT} ${RAMP_POLICY:+--policy "$RAMP_POLICY"} \
      --out /tmp/ramp/"$n".json ${MERGE:+--merge $MERGE} 2>&1 | grep -vE "^(INFO|DEBUG|WARNING|\(EngineCore|\(APIServer)" | tail -60 || true
    cp /tmp/ramp/"$n".* /tmp/ramp/"$n"-bias.png "$OUT/" 2>/dev/null || true
    ls -l "$OUT" ;;
  generalization)
    # the generalization suite (held-out task families) of each router in ROUTERS, concurrently on the one GPU
    # (the torch path at <= 4K tokens is launch-bound: two processes share it well); SAMPLES caps each
    # (family, category) cell; MARGINS: the sa_margin sweep; back: OUT/gen-<name>.tgz per router
    M=$(demo)
    i=0
    for R in ${ROUTERS:?ROUTERS: router folders}; do
      i=$((i + 1)); name=$(basename "$R")
      (python3 benchmarks/accuracy.py --suite generalization-split --model "$M" --router "$R" --out "/tmp/gen-$name" \
        --device cuda --samples ${SAMPLES:-8} ${MARGINS:+--margins $MARGINS} --time-budget ${BUDGET:-420} \
        > "/tmp/gen-$name.log" 2>&1; echo "rc=$?" >> "/tmp/gen-$name.log"
       tar -C /tmp -czf "$OUT/gen-$name.tgz" "gen-$name" "gen-$name.log") &
    done
    wait
    for R in $ROUTERS; do tail -n 45 "/tmp/gen-$(basename "$R").log"; done ;;
  kernels)
    gpu_tests ${CHECK_TIMEOUT:-200} test_gpu_kernels.py "$OUT/check_kernels.json"
    # the whole grid takes ~7 min on the H200: SECTIONS (kernels.py --sections) or QUICK=1 (--quick) split it;
    # KERNEL_BENCH=0: the checks only
    [ "${KERNEL_BENCH:-1}" = 0 ] || python3 benchmarks/kernels.py --out "$OUT/kernels.json" \
      ${SECTIONS:+--sections "$SECTIONS"} ${QUICK:+--quick} 2>&1 | tail -45 ;;
  tune)
    python3 tools/tune_kernels.py --out "$OUT/tune.json" ${SECTIONS:+--sections "$SECTIONS"} 2>&1 | tail -45 ;;
  ab)
    # the kernels of this tree vs the elastic_vllm/ops/ of another commit (`bash tools/ab_prep.sh REF`, carry .abtest), in
    # one call: same GPU, same clocks and power state. SECTIONS: kernels.py's --sections filter; CHECK_K: the
    # GPU tests of this tree first (test_gpu_kernels.py -k); KERNELS_ARGS: more kernels.py flags (--quick, or
    # --cpu-dry for a plumbing check). Back: kernels-tree.json, kernels-ref.json (env.ops_sha256 names the
    # sources each side timed), check-kernels-tree.json
    ab=${AB_DIR:-.abtest}
    [ -f "$ab/REF" ] || { echo "no $ab/REF: run tools/ab_prep.sh REF and carry .abtest"; exit 2; }
    ref=$(cat "$ab/REF")
    mkdir -p "$OUT"
    if [ -n "${CHECK_K:-}" ]; then
      gpu_tests ${CHECK_TIMEOUT:-200} test_gpu_kernels.py "$OUT/check-kernels-tree.json" -k "$CHECK_K"
    fi
    rm -rf /tmp/ab-ref && mkdir -p /tmp/ab-ref && cp -r benchmarks tests elastic_vllm /tmp/ab-ref/ \
      && rm -rf /tmp/ab-ref/elastic_vllm/ops && cp -r "$ab/ops" /tmp/ab-ref/elastic_vllm/ops
    for side in tree ref; do
      dir=$PWD; commit=${GIT_COMMIT:-unknown}
      [ $side = ref ] && { dir=/tmp/ab-ref; commit=$ref; }
      (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=$dir python3 benchmarks/kernels.py ${KERNELS_ARGS:-} \
        --out "$OUT/kernels-$side.json" --sections "${SECTIONS:?kernels.py --sections filter}" \
        2>&1 | tail -12)
    done ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
