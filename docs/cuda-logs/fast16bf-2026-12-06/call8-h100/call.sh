#!/usr/bin/env bash
# Call 8 (f57ec9c and on: tensor-core GEMMs read BF16-valued FP32 operands, CUBLAS_COMPUTE_32F_FAST_16BF,
# against LOCKSTEP_GEMM=bf16-packed, the packing the build before did): GPU tests in both modes;
# nightly throughput by layout and mode; metrics of the two modes; step benchmark; decode graph;
# 6x32x100; the nightly from an empty cache; a kernel profile of one 15-run batch.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
wall() { local a=$(date +%s.%N); "$@"; local rc=$?; local b=$(date +%s.%N); awk -v a=$a -v b=$b -v rc=$rc 'BEGIN{printf "wall %.2f s rc %d\n", b-a, rc}'; }
tar xJf target/gpuz/bundle.txz -C /tmp
N=/tmp/b/lockstep
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R/conv" quick > $R/tests-summary.log 2>&1
echo "tests (default) done at $(el) s" >> $R/times.txt
LOCKSTEP_GEMM=bf16-packed bash /tmp/b/gpu-check.sh /tmp/b "$R/packed" quick > $R/tests-summary-packed.log 2>&1
echo "tests (packed) done at $(el) s" >> $R/times.txt
{ echo "== nightly from an empty cache (default)"; LOCKSTEP_CACHE=/tmp/c0 wall timeout 60 $N run suites/nightly.toml --device cuda --store /tmp/s0 2>&1 | grep -E "done in|warm start" | tail -3; } > $R/nightly-cold.log 2>&1
export LOCKSTEP_CACHE=/tmp/c
{ echo "== bf16 (FAST_16BF)"; timeout 100 $N bench sweep --device cuda --layouts 1x2b16,1x1b16,2x4:host
  echo "== bf16-packed"; LOCKSTEP_GEMM=bf16-packed timeout 60 $N bench sweep --device cuda --layouts 1x2b16,1x1b16
  echo "== bf16 again"; timeout 40 $N bench sweep --device cuda --layouts 1x2b16
  echo "== bf16-packed again"; LOCKSTEP_GEMM=bf16-packed timeout 40 $N bench sweep --device cuda --layouts 1x2b16; } > $R/sweep.log 2>&1
echo "sweeps done at $(el) s" >> $R/times.txt
rm -rf /tmp/sp1 /tmp/sc1 /tmp/bl
LOCKSTEP_GEMM=bf16-packed $N run suites/nightly.toml --device cuda --store /tmp/sp1 2>&1 | grep "done in" > $R/metrics.log
$N run suites/nightly.toml --device cuda --store /tmp/sc1 2>&1 | grep "done in" >> $R/metrics.log
$N baseline save --suite suites/nightly.toml --store /tmp/sp1 --baselines /tmp/bl >> $R/metrics.log 2>&1
$N baseline diff --suite suites/nightly.toml --store /tmp/sc1 --baselines /tmp/bl >> $R/metrics.log 2>&1; echo "diff rc $?" >> $R/metrics.log
echo "metrics done at $(el) s" >> $R/times.txt
for r in bf16 nvfp4-dq; do for m in bf16 bf16-packed; do
  echo "== $m, $r"; LOCKSTEP_GEMM=$m timeout 60 $N bench step --device cuda --model small --steps 3 --recipe $r --batch-runs 1,16 2>&1 | grep -E "runs? (alone|together), state on the GPU" -A1
done; done > $R/step.log 2>&1
echo "step done at $(el) s" >> $R/times.txt
timeout 60 $N bench decode --device cuda --model small --recipes bf16,nvfp4-dq --batch-runs 1,16 --seqs 128 --reps 30 > $R/decode-graph.log 2>&1; echo "rc $?" >> $R/decode-graph.log
echo "decode done at $(el) s" >> $R/times.txt
{ echo "== this build, nightly, warm start cached, default layout"; wall $N run suites/nightly.toml --device cuda --store /tmp/sn1 2>&1 | grep -E "done in" | tail -2
  echo "== this build again"; wall $N run suites/nightly.toml --device cuda --store /tmp/sn2 2>&1 | grep -E "done in" | tail -2; } > $R/nightly-warm.log 2>&1
echo "warm nightlies done at $(el) s" >> $R/times.txt
S6=docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml
left=$(( 470 - $(el) ))
if [ $left -gt 75 ]; then rm -rf /tmp/s6; t0=$(date +%s.%N); timeout $left $N run $S6 --device cuda --store /tmp/s6 2>&1 | grep -v "^\[" | tail -1 > $R/sweep6x32.log; t1=$(date +%s.%N)
  awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/sweep6x32.log; fi
echo "6x32 done at $(el) s" >> $R/times.txt
P=docs/cuda-logs/profile-2026-12-06/profile15.toml
$N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $R/plain.log 2>&1
left=$(( 580 - $(el) ))
if [ $left -gt 40 ]; then
  timeout $left ncu -c 15000 --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu.csv $N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $R/ncu-run.log 2>&1
  echo "rc $?" >> $R/ncu-run.log
  python3 docs/cuda-logs/profile-2026-12-06/ncu_summary.py $R/ncu.csv > $R/ncu-summary.txt 2>&1; xz -9 $R/ncu.csv
fi
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
