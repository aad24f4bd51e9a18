#!/usr/bin/env bash
# The GPU check: run from the repo root on the machine with the GPU (one H200), at most
# ~5 minutes in all (GPU_CHECK_BUDGET_S, default 290; each step is cut at its own share).
#
# What it measures:
#   1. pytest: the CUDA decode paths (tests/gpu: static vs varlen path, MTP k=1/k=2 vs off,
#      the host KV tier: pinned rows, staged copies, asyncWrite, swap;
#      float32, token for token) and tests/engine/test_static_decode.py.
#   2. engine_step eager: engine-level decode step time, tokens/s and tokens/step, MTP off vs
#      k=1 vs k=2 at batch 1 and 16, on a ~1.6B-parameter DeepSeek-V3-shaped random model
#      (bf16) edited for high MTP acceptance; plus a greedy lossless check.
#   3. engine_step compiled: the same with EngineConfig(compile="on"), i.e. torch.compile of
#      the static decode step (Inductor generating Triton kernels).  This is NOT CUDA
#      graphs: there is no CUDA-graph capture path in the engine yet.
#   4. bench_http: the bundled demo model through the HTTP daemon (benchmarks/serve.py,
#      MTP off vs k=1 vs k=2, concurrency 1/16/64).
#   5. bench_tp: one process vs tensor parallel over two GPUs (only with >= 2 GPUs).
# Outputs: $OUT_DIR/<step>.log for every step, gpu_bench_eager.json, gpu_bench_compiled.json,
# gpu_bench_http.json; OUT_DIR = $OUT (the device tool's output folder) or /tmp/gpu_check.
#
# The image has torch with CUDA but maybe not the serving/test packages: their wheels are
# prepared beforehand, on a machine with network, by scripts/gpu_wheels.sh into .whl/ and
# installed here into /tmp/site (no network needed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BUDGET_S="${GPU_CHECK_BUDGET_S:-290}"
START=$SECONDS
declare -a SUMMARY=()
FAILED=0

# run_step NAME MAX_SECONDS CMD...: output tee'd to $OUT_DIR/NAME.log; cut after
# min(MAX_SECONDS, what is left of the budget) with SIGINT (pytest then prints its summary,
# benchmarks.serve stops its daemons), SIGKILL 15 s later.
run_step() {
  local name="$1" max="$2"; shift 2
  local left=$((BUDGET_S - (SECONDS - START) - 5))
  local limit=$((max < left ? max : left))
  if ((limit < 10)); then
    echo "=== $name: skipped (budget spent)" | tee "$OUT_DIR/$name.log"
    SUMMARY+=("$name: skipped (budget spent)"); FAILED=1; return 0
  fi
  echo "=== $name (limit ${limit}s): $*" | tee "$OUT_DIR/$name.log"
  local t0=$SECONDS rc
  set +e
  timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  local what="rc=$rc"
  ((rc == 124)) && what="TIMED OUT after ${limit}s"
  SUMMARY+=("$name: $what ($((SECONDS - t0))s)")
  echo "=== $name: $what ($((SECONDS - t0))s)" | tee -a "$OUT_DIR/$name.log"
  ((rc == 0)) || FAILED=1
}

{
  if [[ -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv || true
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available(), "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
} 2>&1 | tee "$OUT_DIR/env.log"
# The export above ran in the pipeline's subshell; repeat it here.
[[ -d /tmp/site ]] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

run_step pytest 110 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/engine/test_static_decode.py -x
run_step bench_eager 50 python3 -m benchmarks.engine_step --size big --dtype bf16 --compile off \
  --json "$OUT_DIR/gpu_bench_eager.json"
# torch.compile (Inductor -> Triton kernels) of the static decode step; not CUDA graphs,
# which the engine does not have yet.
run_step bench_compiled 100 python3 -m benchmarks.engine_step --size big --dtype bf16 --compile on \
  --json "$OUT_DIR/gpu_bench_compiled.json"
run_step bench_http 300 python3 -m benchmarks.serve --quick --no-peer --concurrency 1,16,64 \
  --json "$OUT_DIR/gpu_bench_http.json"

# Tensor parallel over two GPUs (NCCL for the model's collectives): only where the device
# machine has at least two; one H200 (today's loan) skips it and says so.
if (( $(nvidia-smi -L 2>/dev/null | wc -l) >= 2 )); then
  run_step bench_tp 120 python3 -m benchmarks.serve --compare tp --quick --concurrency 1,16 \
    --json "$OUT_DIR/gpu_bench_tp.json"
else
  echo "=== bench_tp: skipped (tensor parallel needs two GPUs; this machine has fewer)" \
    | tee "$OUT_DIR/bench_tp.log"
  SUMMARY+=("bench_tp: skipped (fewer than two GPUs)")
fi

echo "=== summary ($((SECONDS - START))s in all)" | tee "$OUT_DIR/summary.log"
printf '  %s\n' "${SUMMARY[@]}" | tee -a "$OUT_DIR/summary.log"
exit "$FAILED"
