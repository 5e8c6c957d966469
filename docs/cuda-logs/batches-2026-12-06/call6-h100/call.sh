#!/usr/bin/env bash
# Call 6 (c783d71): the defaults as a user gets them: the nightly from an empty cache, the 6x32x100
# sweep, and the nightly's batches against the former one-run worker pool.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
xz -dc target/gpuz/new.xz > /tmp/new && chmod +x /tmp/new
N=/tmp/new
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv,noheader > $R/machine.txt
export LOCKSTEP_CACHE=/tmp/c6
rm -rf /tmp/c6 /tmp/s6n; t0=$(date +%s.%N); timeout 90 $N run suites/nightly.toml --device cuda --store /tmp/s6n 2>&1 | grep -E "^suite|warm start|done in" > $R/nightly-cold.log; t1=$(date +%s.%N); awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/nightly-cold.log
echo "nightly done at $(el) s" >> $R/times.txt
S6=docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml
rm -rf /tmp/s66; t0=$(date +%s.%N); timeout 150 $N run $S6 --device cuda --store /tmp/s66 2>&1 | grep -E "^suite|warm start|done in" > $R/sweep6x32.log; t1=$(date +%s.%N); awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/sweep6x32.log
echo "6x32 done at $(el) s" >> $R/times.txt
timeout 150 $N bench sweep --device cuda --layouts 1x2b16,2x4:host > $R/sweep.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
