#!/usr/bin/env bash
# Where the worker pool's time goes on one GPU (issue 26): the nightly suite on cuda:0 at each
# worker count of $JOBS (default "1 8") for each LABEL:BINARY given, after one sweep that primes
# the warm-start cache; per sweep its wall time and mean per-phase step times
# (scripts/phase-times.py), SM use during the first binary's largest sweep, and whether every
# sweep gave the first one's metrics. Run from the repository root on a GPU machine:
#   JOBS="1 8 16" scripts/sweep-phases.sh OUT new:/tmp/b/lockstep old:/tmp/old-lockstep
set -u
OUT=${1:?output folder}
shift
S=/tmp/sweep-phases
rm -rf "$S" && mkdir -p "$S" "$OUT"
export LOCKSTEP_CACHE=$S/cache
JOBS=${JOBS:-1 8}
last=${JOBS##* }
{
  first=${1#*:}
  "$first" run suites/nightly.toml --device cuda:0 --jobs 8 --store "$S/prime" 2>&1 | grep -E "^done"
  for lb in "$@"; do
    label=${lb%%:*} bin=${lb#*:}
    for j in $JOBS; do
      echo "==== $label: lockstep run suites/nightly.toml --device cuda:0 --jobs $j (warm start cached)"
      [ "$lb" = "$1" ] && [ "$j" = "$last" ] && { nvidia-smi dmon -s u -c 20 > "$S/dmon.txt" 2>&1 & }
      "$bin" run suites/nightly.toml --device cuda:0 --jobs "$j" --store "$S/$label-j$j" 2>&1 | grep -E "^done"
      python3 scripts/phase-times.py "$S/$label-j$j" nightly | grep -v tokens_per_s
    done
  done
  wait
  echo "==== nvidia-smi dmon during the first binary's $last-worker sweep"
  cat "$S/dmon.txt"
  for store in "$S"/*-j*; do python3 scripts/same-metrics.py "$S/prime" "$store" nightly | tail -1; done
} > "$OUT/sweeps.log" 2>&1
cat "$OUT/sweeps.log"
