#!/usr/bin/env bash
# Call 2: cudarc/rayon at opt-level 3 (new) against 11fc3c4 (old); batch composition in manifests.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
for b in new old; do xz -dc target/gpuz/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; nproc; ls /usr/local/cuda/bin; which nsys ncu nvidia-cuda-mps-control; } > $R/machine.txt 2>&1
for i in 1 2; do
  for b in old new; do
    echo "== $b ($i)"; timeout 100 /tmp/$b bench sweep --device cuda --layouts 1x2b16,3x1b10
  done
done > $R/sweep.log 2>&1
echo "ab done at $(el) s" >> $R/times.txt
{ echo "== new: composition check"; timeout 120 /tmp/new bench sweep --device cuda --layouts 1x2b16,2x1b16,1x2b16,1x1b16; } > $R/compare.log 2>&1
echo "compare done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
for b in old new; do echo "== $b"; timeout 100 /tmp/$b bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 1,16; done > $R/step.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
tar cf $OUT/results.tar -C $OUT r && rm -rf $R
