#!/usr/bin/env bash
# Call 11 (ef94027, the final head: call 10's code plus the bench-decode import tidy-up and the emulator test):
# Every GPU test file of the bundle; bench decode; the nightly against the 2x4 one-run pool; the step benchmark.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
N=/tmp/b/lockstep
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R/tests" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
timeout 60 $N bench decode --device cuda --model small --recipes bf16,nvfp4-dq --batch-runs 1,16 --seqs 128 --reps 30 > $R/decode-graph.log 2>&1; echo "rc $?" >> $R/decode-graph.log
export LOCKSTEP_CACHE=/tmp/c
timeout 120 $N bench sweep --device cuda --layouts 1x2b16,2x4:host > $R/sweep.log 2>&1
for r in bf16 nvfp4-dq; do echo "== $r"; timeout 60 $N bench step --device cuda --model small --steps 3 --recipe $r --batch-runs 1,16 2>&1 | grep -E "runs? (alone|together), state on the GPU" -A1; done > $R/step.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
