#!/usr/bin/env bash
# This stop's head (bd85c71: inference passes quantize runs of one forward as one group; quantizers read a BF16
# rounding as they load; dy unrounded to GEMMs that round; weights prepared with fewer roundings) against 911d589 (target/gpuz/base/lockstep.xz) in one call: GPU tests,
# the nightly alternated and its metrics compared, sweep throughput, the step benchmark, and a
# kernel profile of the nightly's two batches (2 steps) for both builds.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
# Seconds the call may take (the device's limit less a margin for packing the results).
LIMIT=${LIMIT:-560}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
wall() { local a=$(date +%s.%N); "$@"; local rc=$?; local b=$(date +%s.%N); awk -v a=$a -v b=$b -v rc=$rc 'BEGIN{printf "wall %.2f s rc %d\n", b-a, rc}'; }
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/base/lockstep.xz > /tmp/old && chmod +x /tmp/old
N=/tmp/b/lockstep; O=/tmp/old
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
timeout 110 bash /tmp/b/gpu-check.sh /tmp/b "$R/tests" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
run() { local name=$1; shift; echo "== $name"; wall "$@" 2>&1 | grep -E "done in|^wall" | tail -3; }
{
  run "new, warm start (empty cache)" timeout 60 $N run suites/nightly.toml --device cuda --store /tmp/s0
  for i in 1 2; do
    run "old 911d589 ($i)" timeout 60 $O run suites/nightly.toml --device cuda --store /tmp/so$i
    run "new ($i)" timeout 60 $N run suites/nightly.toml --device cuda --store /tmp/sn$i
  done
} > $R/nightly.log 2>&1
python3 scripts/same-metrics.py /tmp/so1 /tmp/sn1 nightly > $R/same-metrics.log 2>&1 || true
echo "nightly done at $(el) s" >> $R/times.txt
{ echo "== new"; timeout 70 $N bench sweep --device cuda --layouts 1x2b16,1x1b16
  echo "== old 911d589"; timeout 70 $O bench sweep --device cuda --layouts 1x2b16,1x1b16; } > $R/sweep.log 2>&1
echo "sweeps done at $(el) s" >> $R/times.txt
for r in bf16 mxfp8 nvfp4-dq; do for b in new old; do B=$N; [ $b = old ] && B=$O
  echo "== $b, $r"; timeout 40 $B bench step --device cuda --model small --steps 3 --recipe $r --batch-runs 1,16 2>&1 | grep -E "runs? (alone|together), state on the GPU" -A1
done; done > $R/step.log 2>&1
echo "step done at $(el) s" >> $R/times.txt
P=docs/cuda-logs/loads-2026-12-07/profile-n2.toml
for b in new old; do B=$N; [ $b = old ] && B=$O
  left=$(( LIMIT - $(el) )); [ $left -lt 40 ] && break
  timeout $left ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu-$b.csv $B run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp-$b --force > $R/ncu-run-$b.log 2>&1
  echo "rc $?" >> $R/ncu-run-$b.log
  python3 docs/cuda-logs/profile-2026-12-06/ncu_summary.py $R/ncu-$b.csv > $R/ncu-summary-$b.txt 2>&1
  gzip -f $R/ncu-$b.csv
done
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
