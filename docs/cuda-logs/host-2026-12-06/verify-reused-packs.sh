#!/usr/bin/env bash
# Reused BF16 pack buffers (this tree) against 8e9362d (hp/lockstep.xz): GPU tests, the nightly
# alternated, host profiles of the nightly (default, and one worker), the sweep and step benchmarks.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R/prof
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
wall() { local a=$(date +%s.%N); "$@"; local rc=$?; local b=$(date +%s.%N); awk -v a=$a -v b=$b -v rc=$rc 'BEGIN{printf "wall %.2f s rc %d\n", b-a, rc}'; }
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/hp/lockstep.xz > /tmp/old && chmod +x /tmp/old
N=/tmp/b/lockstep; O=/tmp/old; P=$PWD/target/gpuz/hp/hostprof.so
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
timeout 100 bash /tmp/b/gpu-check.sh /tmp/b "$R/tests" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
run() { local name=$1; shift; echo "== $name"; wall "$@" 2>&1 | grep -E "done in|hostprof|^wall" | tail -4; }
{
  run "new, warm start (empty cache)" $N run suites/nightly.toml --device cuda --store /tmp/s0
  for i in 1 2; do
    run "old 8e9362d, default ($i)" $O run suites/nightly.toml --device cuda --store /tmp/so$i
    run "new, default ($i)" $N run suites/nightly.toml --device cuda --store /tmp/sn$i
  done
  run "new, default, profiled" env HOSTPROF_OUT=$R/prof/default LD_PRELOAD=$P $N run suites/nightly.toml --device cuda --store /tmp/sp1
  run "new, one worker of 16, profiled" env HOSTPROF_OUT=$R/prof/one LD_PRELOAD=$P $N run suites/nightly.toml --device cuda --jobs 1 --batch-runs 16 --store /tmp/sp2
} > $R/runs.log 2>&1
python3 scripts/same-metrics.py /tmp/so1 /tmp/sn1 nightly > $R/same-metrics.log 2>&1 || true
echo "runs done at $(el) s" >> $R/times.txt
timeout 40 $N bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 1,16 2>&1 | grep -E "runs? (alone|together), state on the GPU" -A1 > $R/step.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
ls -la $R/prof >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
