#!/usr/bin/env bash
# Call 1: tests of 11fc3c4; nightly by layout (threads vs processes at 10-16 runs a batch); 6x32x100.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
true
N=/tmp/b/lockstep
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
nproc >> $R/machine.txt; which perf gdb cuda-gdb nsys py-spy >> $R/machine.txt 2>&1; ls /usr/local/cuda/bin >> $R/machine.txt 2>&1
bash /tmp/b/gpu-check.sh /tmp/b "$R" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
timeout 200 $N bench sweep --device cuda --layouts 1x2b16,2x1b16,1x3b10,3x1b10,2x2b8,1x1b32,2x1b32 > $R/sweep.log 2>&1
echo "sweeps done at $(el) s" >> $R/times.txt
S6=docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml
for lay in "" "--processes 2 --jobs 2 --batch-runs 16" "--processes 3 --jobs 3 --batch-runs 16"; do
  left=$(( 540 - $(el) )); [ $left -lt 80 ] && break
  rm -rf /tmp/s6; echo "== layout: ${lay:-default}" >> $R/sweep6x32.log
  t0=$(date +%s.%N); timeout $left $N run $S6 --device cuda --store /tmp/s6 $lay 2>&1 | grep -v "^\[" | tail -4 >> $R/sweep6x32.log; t1=$(date +%s.%N)
  awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/sweep6x32.log
done
echo "all done at $(el) s" >> $R/times.txt
tar cf $OUT/results.tar -C $OUT r && rm -rf $R
