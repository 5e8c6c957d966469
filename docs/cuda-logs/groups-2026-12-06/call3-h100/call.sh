#!/usr/bin/env bash
# Call 3 (345ae4b: BF16 rounding left to the GEMM in inference passes; plan groups read through
# views, grouped by what a site computes; one wgrad tensor where dy is not quantized): GPU tests of the bundle; against the build before (0a1c4fb) in the same call: nightly
# throughput by layout, metrics, step, 6x32x100; the nightly from an empty warm-start cache; a
# kernel profile of one 15-run batch.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/old.xz > /tmp/old && chmod +x /tmp/old
N=/tmp/b/lockstep; O=/tmp/old
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
rm -rf /tmp/c0 /tmp/s0; t0=$(date +%s.%N); LOCKSTEP_CACHE=/tmp/c0 timeout 60 $N run suites/nightly.toml --device cuda --store /tmp/s0 2>&1 | grep -E "done in" > $R/nightly-cold.log; t1=$(date +%s.%N); awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/nightly-cold.log
export LOCKSTEP_CACHE=/tmp/c
{ echo "== new"; timeout 120 $N bench sweep --device cuda --layouts 1x2b16,1x1b16,2x1b16,2x4:host; echo "== old (0a1c4fb)"; timeout 60 $O bench sweep --device cuda --layouts 1x2b16,1x1b16; echo "== new again"; timeout 60 $N bench sweep --device cuda --layouts 1x2b16; } > $R/sweep.log 2>&1
echo "sweeps done at $(el) s" >> $R/times.txt
rm -rf /tmp/so /tmp/sn /tmp/bl
$O run suites/nightly.toml --device cuda --store /tmp/so 2>&1 | grep "done in" > $R/metrics.log
$N run suites/nightly.toml --device cuda --store /tmp/sn 2>&1 | grep "done in" >> $R/metrics.log
$N baseline save --suite suites/nightly.toml --store /tmp/so --baselines /tmp/bl >> $R/metrics.log 2>&1
$N baseline diff --suite suites/nightly.toml --store /tmp/sn --baselines /tmp/bl >> $R/metrics.log 2>&1; echo "diff rc $?" >> $R/metrics.log
echo "metrics done at $(el) s" >> $R/times.txt
for r in bf16 nvfp4-dq; do for b in new old; do B=$N; [ $b = old ] && B=$O
  echo "== $b, $r"; timeout 60 $B bench step --device cuda --model small --steps 3 --recipe $r --batch-runs 1,16 2>&1 | grep -E "runs? (alone|together), state on the GPU" -A1
done; done > $R/step.log 2>&1
echo "step done at $(el) s" >> $R/times.txt
S6=docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml
for b in new old; do B=$N; [ $b = old ] && B=$O
  left=$(( 470 - $(el) )); [ $left -lt 75 ] && break
  rm -rf /tmp/s6; echo "== $b" >> $R/sweep6x32.log
  t0=$(date +%s.%N); timeout $left $B run $S6 --device cuda --store /tmp/s6 2>&1 | grep -v "^\[" | tail -1 >> $R/sweep6x32.log; t1=$(date +%s.%N)
  awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/sweep6x32.log
done
P=docs/cuda-logs/profile-2026-12-06/profile15.toml
$N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $R/plain.log 2>&1
left=$(( 585 - $(el) ))
if [ $left -gt 40 ]; then
  timeout $left ncu -c 15000 --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu.csv $N run $P --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp --force > $R/ncu-run.log 2>&1
  echo "rc $?" >> $R/ncu-run.log
  python3 docs/cuda-logs/profile-2026-12-06/ncu_summary.py $R/ncu.csv > $R/ncu-summary.txt 2>&1; xz -9 $R/ncu.csv
fi
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
