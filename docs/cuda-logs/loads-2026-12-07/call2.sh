#!/usr/bin/env bash
# The nightly through build d482fbb (the worker pool whose sweep issue 26 measured: 8 one-run
# workers; target/gpuz2/old/d482.xz) and through this stop's head (target/gpuz2/new/lockstep.xz,
# the default layout), alternated, each with its warm start trained beforehand and cached.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
wall() { local a=$(date +%s.%N); "$@"; local rc=$?; local b=$(date +%s.%N); awk -v a=$a -v b=$b -v rc=$rc 'BEGIN{printf "wall %.2f s rc %d\n", b-a, rc}'; }
xz -dc target/gpuz2/old/d482.xz > /tmp/d482 && xz -dc target/gpuz2/new/lockstep.xz > /tmp/new && chmod +x /tmp/d482 /tmp/new
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
export LOCKSTEP_CACHE=/tmp/c2
run() { local name=$1; shift; echo "== $name"; wall "$@" 2>&1 | grep -E "done in|^wall" | tail -3; }
{
  run "new, warm start (empty cache)" timeout 60 /tmp/new run suites/nightly.toml --device cuda --store /tmp/w-new
  run "d482fbb, 8 workers, warm start" timeout 150 /tmp/d482 run suites/nightly.toml --device cuda --jobs 8 --store /tmp/w-old
  for i in 1 2; do
    run "d482fbb, 8 workers ($i)" timeout 90 /tmp/d482 run suites/nightly.toml --device cuda --jobs 8 --store /tmp/o$i
    run "new, default ($i)" timeout 60 /tmp/new run suites/nightly.toml --device cuda --store /tmp/n$i
  done
} > $R/against-d482.log 2>&1
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
