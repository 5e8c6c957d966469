#!/usr/bin/env bash
# Device call: the bundle of 25992ba (rmsnorm_backward_dg's loads overlapped): every GPU test file, and
# a 32-run bf16 step beside be44b25 (the first tensor-core build).
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/prev.xz > /tmp/prev && chmod +x /tmp/prev
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
for b in /tmp/b/lockstep /tmp/prev /tmp/b/lockstep; do echo "== $b"; timeout 60 $b bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 32 2>&1 | grep -E "together|export"; done > $R/step-bf16.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
tar cf $OUT/results.tar -C $OUT r && rm -rf $R
