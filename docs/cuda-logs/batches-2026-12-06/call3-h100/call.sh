#!/usr/bin/env bash
# Call 3 (3fab747): where a one-worker batch waits (cuda-gdb samples); layouts of processes x
# workers with the same batches; 6x32x100 by layout.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R/samples
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
xz -dc target/gpuz/sym.xz > /tmp/new && chmod +x /tmp/new
N=/tmp/new
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
export LOCKSTEP_CACHE=/tmp/c
timeout 60 $N run suites/nightly.toml --device cuda --processes 1 --jobs 1 --batch-runs 16 --store /tmp/s0 2>&1 | grep -E "warm start|done in" > $R/plain.log
( timeout 90 $N run suites/nightly.toml --device cuda --processes 1 --jobs 1 --batch-runs 16 --store /tmp/s1 2>&1 | grep -E "done in" > $R/sampled.log ) &
sleep 3
PID=$(pgrep -f "store /tmp/s1" | head -1)
echo "pid $PID" >> $R/sampled.log
for i in $(seq 1 14); do
  timeout 20 cuda-gdb -p $PID -batch -ex "thread apply all bt 14" > $R/samples/s$i.txt 2>&1
  sleep 0.3
done
wait
echo "samples done at $(el) s" >> $R/times.txt
timeout 150 $N bench sweep --device cuda --layouts 1x2b16,2x1b16,1x1b16,3x1b10,3x1b16,4x1b8 > $R/sweep.log 2>&1
echo "sweep done at $(el) s" >> $R/times.txt
S6=docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml
for lay in "" "--processes 3 --jobs 3 --batch-runs 16" "--processes 4 --jobs 4 --batch-runs 16"; do
  left=$(( 560 - $(el) )); [ $left -lt 80 ] && break
  rm -rf /tmp/s6; echo "== layout: ${lay:-default}" >> $R/sweep6x32.log
  t0=$(date +%s.%N); timeout $left $N run $S6 --device cuda --store /tmp/s6 $lay 2>&1 | grep "done in" >> $R/sweep6x32.log; t1=$(date +%s.%N)
  awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/sweep6x32.log
done
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
