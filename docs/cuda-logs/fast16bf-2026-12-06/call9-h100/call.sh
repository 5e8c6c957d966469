#!/usr/bin/env bash
# Call 9 (the build of call 8): the nightly as the issue measured it (build d482fbb, 8 workers, its
# warm start trained beforehand on a CPU and carried) beside this build's default, the same build
# with LOCKSTEP_GEMM=bf16-packed (the packing the build before did), and its 8 one-run workers, on
# one machine; each `lockstep run suites/nightly.toml --device cuda`, warm start cached.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
wall() { local a=$(date +%s.%N); "$@"; local rc=$?; local b=$(date +%s.%N); awk -v a=$a -v b=$b -v rc=$rc 'BEGIN{printf "wall %.2f s rc %d\n", b-a, rc}'; }
xz -dc target/gpuz9/new-lockstep.xz > /tmp/new && chmod +x /tmp/new
xz -dc target/gpuz9/old-d482.xz > /tmp/d482 && chmod +x /tmp/d482
mkdir -p /tmp/c-old && cp target/gpuz9/ws-old/* /tmp/c-old/
N=/tmp/new
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
export LOCKSTEP_CACHE=/tmp/c
run() { local name=$1; shift; echo "== $name"; wall "$@" 2>&1 | grep -E "done in|warm start|^wall" | tail -3; }
{ run "this build, nightly from an empty cache" $N run suites/nightly.toml --device cuda --store /tmp/s0
  for i in 1 2; do
    run "this build, default layout ($i)" $N run suites/nightly.toml --device cuda --store /tmp/s1-$i
    run "this build, LOCKSTEP_GEMM=bf16-packed ($i)" env LOCKSTEP_GEMM=bf16-packed $N run suites/nightly.toml --device cuda --store /tmp/s2-$i
    LOCKSTEP_CACHE=/tmp/c-old run "d482fbb (the issue's sweep), 8 workers ($i)" timeout 100 /tmp/d482 run suites/nightly.toml --device cuda --jobs 8 --store /tmp/s3-$i
  done
  run "this build, 8 one-run workers" $N run suites/nightly.toml --device cuda --jobs 8 --batch-runs 1 --store /tmp/s4
} > $R/against-d482.log 2>&1
echo "runs done at $(el) s" >> $R/times.txt
timeout 120 $N bench sweep --device cuda --layouts 1x2b16,2x4:host > $R/sweep.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
