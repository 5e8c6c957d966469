#!/usr/bin/env bash
# Issue 7's GPU checks in one device call (see docs/cuda.md): every GPU test binary, memcheck on
# the newest ones, the benchmarks with their side-by-side ratios, and a sweep in worker processes
# against one process. Logs go to OUT, five files: machine.txt, tests.log, memcheck.log,
# bench.log, workers.log. Run from the repository root (the last check reads scripts/).
# Usage: gpu-check.sh DIR OUT [quick|batch], DIR the unpacked bundle of scripts/gpu-bundle.sh;
# `quick` runs the tests only; `batch` runs the tests, then issue 26's measurements (runs stepped
# together: bench step --batch-runs for two recipes, bench sweep's default layouts) into
# OUT/batch.log (SWEEP_LAYOUTS overrides the sweep's layouts; MPS_LAYOUTS, when set, sweeps
# those layouts again under MPS into OUT/mps.log).
set -uo pipefail
DIR=${1:?bundle folder}
OUT=${2:?output folder}
mkdir -p "$OUT"
BUILT=$(cat "$DIR/built_in")
mkdir -p "$BUILT/tests" && rm -rf "$BUILT/tests/golden" && cp -r "$DIR/golden" "$BUILT/tests/golden"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/machine.txt" 2>&1
status=0
for t in "$DIR"/cuda_* "$DIR"/model_devices; do
  name=$(basename "$t")
  echo "==== $name" >> "$OUT/tests.log"
  timeout 300 "$t" --test-threads 1 --nocapture > /tmp/gpu-check-test.log 2>&1 || status=1
  cat /tmp/gpu-check-test.log >> "$OUT/tests.log"
  echo "$name: $(grep -E '^test result' /tmp/gpu-check-test.log | tail -1)"
done
[ "${3:-}" = quick ] && exit $status
if [ "${3:-}" = batch ]; then
  export LOCKSTEP_CACHE=/tmp/gpu-check-cache
  # Written as it goes (tee), so that a call cut short still brings back what ran.
  {
    for r in bf16 nvfp4-dq; do
      "$DIR/lockstep" bench step --device cuda --model small --steps 3 --recipe $r --batch-runs 1,8,32
    done
    "$DIR/lockstep" bench sweep --device cuda --layouts "${SWEEP_LAYOUTS:-2x4:host,1x2b16,1x1,1x1b8,1x1b32,1x1b128}"
  } 2>&1 | tee "$OUT/batch.log" || status=1
  # The worker pool under MPS (its processes' kernels then share the GPU at once instead of
  # taking turns by context), where the machine has the daemon.
  MPS=$(command -v nvidia-cuda-mps-control || echo /usr/local/cuda/bin/nvidia-cuda-mps-control)
  if [ -n "${MPS_LAYOUTS:-}" ] && [ -x "$MPS" ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p /tmp/mps-pipe /tmp/mps-log
    {
      "$MPS" -d && echo "mps: daemon started" || echo "mps: daemon did not start"
      "$DIR/lockstep" bench sweep --device cuda --layouts "$MPS_LAYOUTS"
      echo quit | "$MPS"
    } 2>&1 | tee "$OUT/mps.log" || status=1
  elif [ -n "${MPS_LAYOUTS:-}" ]; then
    echo "mps: no nvidia-cuda-mps-control on this machine" | tee "$OUT/mps.log"
  fi
  exit $status
fi
SAN=/usr/local/cuda/bin/compute-sanitizer
if [ -x "$SAN" ]; then
  # The model's passes over GpuOps (the trainer's pass test alone, the end-to-end one is long;
  # the decode and the inference forward) and the linear layer.
  for spec in "cuda_train resident_pass" "cuda_linear" "model_devices decoding" "model_devices inference"; do
    set -- $spec
    name=$1
    [ -x "$DIR/$name" ] || continue
    echo "==== $spec" >> "$OUT/memcheck.log"
    timeout 200 "$SAN" --tool memcheck "$DIR/$name" ${2:-} --test-threads 1 > /tmp/gpu-check-mc.log 2>&1
    cat /tmp/gpu-check-mc.log >> "$OUT/memcheck.log"
    echo "memcheck $name: $(grep 'ERROR SUMMARY' /tmp/gpu-check-mc.log)"
  done
fi
{
  "$DIR/lockstep" bench step --device cuda --model small --steps 3
  "$DIR/lockstep" bench step --device cuda --model small --steps 3 --recipe nvfp4-dq
  "$DIR/lockstep" bench forward --device cuda --reps 10 --recipes bf16,nvfp4-dq,mxfp8,fp8-block
} > "$OUT/bench.log" 2>&1 || status=1
# A sweep in worker processes (the GPU default, 2 per GPU) against the same sweep in one process:
# every run ok, the same metrics (scripts/same-metrics.py, from the repository root).
{
  W=/tmp/gpu-check-workers
  rm -rf "$W" && mkdir -p "$W"
  printf '%s\n' 'name = "workers"' 'seeds = [0, 1, 2]' '[workload]' 'model = "small"' 'steps = 5' \
    '[workload.warm_start]' 'max_steps = 20' '[[configs]]' 'name = "bf16"' 'recipe = "bf16"' \
    '[[configs]]' 'name = "nvfp4-dq"' 'recipe = "nvfp4-dq"' > "$W/workers.toml"
  export LOCKSTEP_CACHE=$W/cache
  "$DIR/lockstep" run "$W/workers.toml" --device cuda --store "$W/split" | grep -E '^(suite|worker|done)'
  "$DIR/lockstep" run "$W/workers.toml" --device cuda --processes 1 --store "$W/one" | grep -E '^done'
  [ -f scripts/same-metrics.py ] && python3 scripts/same-metrics.py "$W/one" "$W/split" workers | tail -1
} > "$OUT/workers.log" 2>&1 || status=1
cat "$OUT/workers.log"
cat "$OUT/bench.log"
exit $status
