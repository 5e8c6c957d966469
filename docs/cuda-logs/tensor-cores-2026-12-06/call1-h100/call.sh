#!/usr/bin/env bash
# Device call: tests of the bundle (BF16 tensor-core GEMMs); FP32-only GEMMs (LOCKSTEP_GEMM=fp32) against the
# default in the same call; a per-kernel profile of one 15-run batch; the 6x32x100 sweep.
set -u
OUT=$1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
N=/tmp/b/lockstep
P=docs/cuda-logs/profile-2026-12-06/profile15.toml
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/machine.txt
(which ncu nsys; ncu --version | tail -1) >> $OUT/machine.txt 2>&1
bash /tmp/b/gpu-check.sh /tmp/b "$OUT" quick > $OUT/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $OUT/times.txt
export LOCKSTEP_CACHE=/tmp/c
for g in fp32 bf16; do echo "== LOCKSTEP_GEMM=$g"; LOCKSTEP_GEMM=$g timeout 100 $N bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 1,8,32; done > $OUT/step-bf16.log 2>&1
echo "step bf16 done at $(el) s" >> $OUT/times.txt
for g in fp32 bf16; do echo "== LOCKSTEP_GEMM=$g"; LOCKSTEP_GEMM=$g timeout 120 $N bench sweep --device cuda --layouts 1x2b16,1x1b32; done > $OUT/sweep.log 2>&1
echo "sweeps done at $(el) s" >> $OUT/times.txt
for g in fp32 bf16; do echo "== LOCKSTEP_GEMM=$g"; LOCKSTEP_GEMM=$g timeout 80 $N bench step --device cuda --model small --steps 3 --recipe mxfp8-dq --batch-runs 1,16; done > $OUT/step-mxfp8.log 2>&1
echo "step mxfp8 done at $(el) s" >> $OUT/times.txt
$N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $OUT/plain.log 2>&1
left=$(( 400 - $(el) )); [ $left -gt 150 ] && left=150
echo "profile starts at $(el) s, cap $left" >> $OUT/times.txt
if [ $left -gt 40 ]; then
  timeout $left ncu -c 15000 --clock-control none --metrics gpu__time_duration.sum --csv --log-file $OUT/ncu.csv $N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $OUT/ncu-run.log 2>&1
  echo "rc $?" >> $OUT/ncu-run.log
  python3 docs/cuda-logs/profile-2026-12-06/ncu_summary.py $OUT/ncu.csv > $OUT/ncu-summary.txt 2>&1; xz -9 $OUT/ncu.csv
fi
echo "profile done at $(el) s" >> $OUT/times.txt
left=$(( 560 - $(el) ))
if [ $left -gt 60 ]; then
  t0=$(date +%s.%N); timeout $left $N run docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml --device cuda --store /tmp/s6 2>&1 | grep -v "^\[" | tail -15 > $OUT/sweep6x32.log; t1=$(date +%s.%N)
  awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $OUT/sweep6x32.log
fi
echo "all done at $(el) s" >> $OUT/times.txt
