#!/usr/bin/env bash
# Call 7 (c783d71): the nightly from an empty warm-start cache on a fresh machine (the driver's
# PTX JIT cache empty too), then again with only the driver's cache kept, then everything cached.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
xz -dc target/gpuz/new.xz > /tmp/new && chmod +x /tmp/new
N=/tmp/new
du -sh ~/.nv/ComputeCache > $R/jit-cache.txt 2>&1
export LOCKSTEP_CACHE=/tmp/c7
for what in "fresh machine" "driver JIT cache kept" "all cached"; do
  [ "$what" = "all cached" ] || rm -rf /tmp/c7
  rm -rf /tmp/s7
  echo "== $what" >> $R/nightly.log
  t0=$(date +%s.%N); timeout 60 $N run suites/nightly.toml --device cuda --store /tmp/s7 2>&1 | grep -E "done in" >> $R/nightly.log; t1=$(date +%s.%N); awk -v a=$t0 -v b=$t1 'BEGIN{print "wall", b-a, "s"}' >> $R/nightly.log
done
du -sh ~/.nv/ComputeCache >> $R/jit-cache.txt 2>&1
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
