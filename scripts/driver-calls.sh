#!/usr/bin/env bash
# CUDA driver and cuBLAS calls per GRPO step on one GPU (issue 26: the worker pool waits on the
# driver, so calls per run-step are what a faster sweep must cut). For each recipe, one run of
# the nightly workload at S and at 2S steps under cuda-gdb, with a counting breakpoint on each
# entry point; (count at 2S - count at S) / S is the count per step, setup and final eval
# cancelled out. Run from the repository root on a GPU machine:
#   scripts/driver-calls.sh /tmp/b/lockstep OUT [recipe ...]   (default: bf16 nvfp4-dq)
set -u
BIN=${1:?lockstep binary}
OUT=${2:?output folder}
shift 2
RECIPES=${*:-bf16 nvfp4-dq}
S=/tmp/driver-calls
STEPS=${STEPS:-3}
rm -rf "$S" && mkdir -p "$S" "$OUT"
export LOCKSTEP_CACHE=$S/cache
CALLS="cuLaunchKernel cuLaunchKernelEx cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2
  cuMemcpyDtoDAsync_v2 cuMemsetD8Async cuMemsetD32Async cuMemAllocAsync cuMemFreeAsync
  cuStreamSynchronize cuEventRecord cuEventSynchronize cuStreamWaitEvent cuMemHostAlloc
  cuMemFreeHost cublasSgemm_v2 cublasSgemmStridedBatched cublasGemmEx cublasSetStream_v2"

# suite NAME RECIPE STEPS: the nightly workload, one seed, no evaluation inside the run.
suite() {
  cat > "$S/$1.toml" <<EOF
name = "$1"
engine = "builtin"
seeds = [0]
[workload]
model = "small"
task = "add:3"
prompts_per_step = 16
samples_per_prompt = 8
max_response_tokens = 6
steps = $3
eval_every = 1000
lr = 1e-4
[workload.warm_start]
lr = 1e-3
[[configs]]
name = "$2"
recipe = "$2"
EOF
}

{
  echo "set pagination off"
  echo "set breakpoint pending on"
  echo "set confirm off"
  n=0
  for c in $CALLS; do echo "break $c"; n=$((n + 1)); done
  echo "commands 1-$n"
  echo "silent"
  echo "continue"
  echo "end"
  echo "run"
  echo "info breakpoints"
} > "$S/count.gdb"

# hits FILE: "call count" per breakpoint from `info breakpoints` (breakpoint N is the Nth call).
hits() {
  awk -v calls="$(echo $CALLS)" 'BEGIN {split(calls, name, " ")}
    /^[0-9]+ +breakpoint/ {num = $1} /breakpoint already hit/ {print name[num], $4}' "$1"
}

suite prime bf16 1
"$BIN" run "$S/prime.toml" --store "$S/store" --device cuda:0 --jobs 1 > "$S/prime.log" 2>&1
tail -2 "$S/prime.log"
for r in $RECIPES; do
  for steps in "$STEPS" $((2 * STEPS)); do
    suite "$r-$steps" "$r" "$steps"
    cuda-gdb -batch -x "$S/count.gdb" --args "$BIN" run "$S/$r-$steps.toml" --store "$S/store" \
      --device cuda:0 --jobs 1 > "$S/$r-$steps.gdb.log" 2>&1
    grep -E '^done' "$S/$r-$steps.gdb.log"
    hits "$S/$r-$steps.gdb.log" > "$S/$r-$steps.hits"
  done
  echo "==== $r: calls per step (steps $((STEPS + 1))-$((2 * STEPS)))"
  join -a2 -e0 -o 0,1.2,2.2 <(sort "$S/$r-$STEPS.hits") <(sort "$S/$r-$((2 * STEPS)).hits") |
    awk -v s="$STEPS" '{d = ($3 - $2) / s; t += d; printf "%-28s %8.1f\n", $1, d} END {printf "%-28s %8.1f\n", "total", t}'
done 2>&1 | tee "$OUT/driver-calls.log"
for f in "$S"/*.gdb.log; do echo "==== $f"; tail -40 "$f"; done > "$OUT/gdb-tails.log" 2>&1
