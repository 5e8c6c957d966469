#!/usr/bin/env bash
# GPU checks and timings for issue 7, in one call on a GPU machine (see docs/cuda.md).
# Usage: scripts/cuda-check.sh DIR OUT, where DIR holds a (stripped) `lockstep` binary, the
# `cuda_quantizer` test binary as `cq` and a copy of tests/golden as `golden`; logs go to OUT.
# The test binary looks for the golden files under the path it was built in ($BUILT, baked in
# by cargo as CARGO_MANIFEST_DIR), so they are copied there first.
set -uo pipefail
DIR=${1:?binary folder}
OUT=${2:?output folder}
BUILT=${BUILT:-/work/wt-cuda}
mkdir -p "$BUILT/tests" "$OUT"
cp -r "$DIR/golden" "$BUILT/tests/golden"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/smi.txt"
echo "== tests"
"$DIR/cq" --test-threads 1 --nocapture 2>&1 | tee "$OUT/tests.log"
echo "== bench quantize"
for i in 1 2; do "$DIR/lockstep" bench quantize --device cuda --size "${SIZE:-16384}" 2>&1 | tee -a "$OUT/bench_quantize.log"; done
echo "== bench step"
for d in cuda cpu; do
  "$DIR/lockstep" bench step --device "$d" --model small --steps "${STEPS:-3}" 2>&1 | tee -a "$OUT/bench_step.log"
done
