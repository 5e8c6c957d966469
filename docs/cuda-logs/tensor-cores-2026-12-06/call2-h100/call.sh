#!/usr/bin/env bash
# Device call: tests of the bundle (0b6d4d6: BF16 tensor-core GEMMs with weights packed once,
# routing by block); FP32-only GEMMs (LOCKSTEP_GEMM=fp32) and the previous build (be44b25:
# tensor cores, weights packed per GEMM, routing a thread an expert) beside it; the 6x32x100
# sweep; a profile.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/prev.xz > /tmp/prev && chmod +x /tmp/prev
N=/tmp/b/lockstep; O=/tmp/prev
P=docs/cuda-logs/profile-2026-12-06/profile15.toml
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
for g in fp32 bf16; do echo "== new, LOCKSTEP_GEMM=$g"; LOCKSTEP_GEMM=$g timeout 100 $N bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 1,8,32; done > $R/step-bf16.log 2>&1
echo "== previous (be44b25)" >> $R/step-bf16.log; timeout 100 $O bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 1,8,32 >> $R/step-bf16.log 2>&1
echo "step bf16 done at $(el) s" >> $R/times.txt
{ echo "== new"; timeout 120 $N bench sweep --device cuda --layouts 1x2b16,1x1b32,2x4:host; echo "== new, LOCKSTEP_GEMM=fp32"; LOCKSTEP_GEMM=fp32 timeout 60 $N bench sweep --device cuda --layouts 1x2b16; echo "== previous (be44b25)"; timeout 60 $O bench sweep --device cuda --layouts 1x2b16; } > $R/sweep.log 2>&1
echo "sweeps done at $(el) s" >> $R/times.txt
rm -rf /tmp/c2 /tmp/s; t0=$(date +%s.%N); LOCKSTEP_CACHE=/tmp/c2 timeout 60 $N run suites/nightly.toml --device cuda --store /tmp/s 2>&1 | grep -E "warm start|done in" > $R/nightly-cold.log; t1=$(date +%s.%N); awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/nightly-cold.log
echo "cold nightly done at $(el) s" >> $R/times.txt
left=$(( 380 - $(el) ))
if [ $left -gt 60 ]; then
  t0=$(date +%s.%N); timeout $left $N run docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml --device cuda --store /tmp/s6 2>&1 | grep -v "^\[" | tail -15 > $R/sweep6x32.log; t1=$(date +%s.%N)
  awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/sweep6x32.log
fi
echo "6x32 done at $(el) s" >> $R/times.txt
$N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $R/plain.log 2>&1
left=$(( 470 - $(el) ))
if [ $left -gt 40 ]; then
  timeout $left ncu -c 15000 --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu.csv $N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $R/ncu-run.log 2>&1
  echo "rc $?" >> $R/ncu-run.log
  python3 docs/cuda-logs/profile-2026-12-06/ncu_summary.py $R/ncu.csv > $R/ncu-summary.txt 2>&1; xz -9 $R/ncu.csv
fi
echo "all done at $(el) s" >> $R/times.txt
tar cf $OUT/results.tar -C $OUT r && rm -rf $R
