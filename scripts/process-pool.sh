#!/usr/bin/env bash
# Worker threads in one process against worker processes on one GPU (issue 26): the nightly
# suite on cuda:0, warm start cached, run by P processes of J workers each sharing one store
# (the store hands each run to one process), for each "PxJ" of $SHAPES. Prints each sweep's
# wall time; checks every store's metrics against the first. A shape ending in `t` ("4x2t")
# pins each process to its own share of the cores (taskset), so each sizes its thread pools to
# that share; "1x4.2" repeats 1x4 into a store of its own. Run from the repository root:
#   SHAPES="1x4 4x1 8x1 4x2 4x2t" scripts/process-pool.sh /tmp/b/lockstep OUT
set -u
BIN=${1:?lockstep binary}
OUT=${2:?output folder}
S=/tmp/process-pool
rm -rf "$S" && mkdir -p "$S" "$OUT"
export LOCKSTEP_CACHE=$S/cache
SHAPES=${SHAPES:-1x4 4x1 8x1 4x2}
{
  "$BIN" run suites/nightly.toml --device cuda:0 --jobs 8 --store "$S/prime" 2>&1 | grep -E "^done"
  for shape in $SHAPES; do
    # "4x2t": pinned; anything after the digits ("1x4.2", a repeat) only names the store.
    p=${shape%%x*} j=${shape#*x} pin=
    [[ $j == *t* ]] && pin=1
    j=${j%%[!0-9]*}
    cores=$(nproc) t0=$(date +%s%N)
    for i in $(seq "$p"); do
      run=("$BIN" run suites/nightly.toml --device cuda:0 --jobs "$j" --store "$S/$shape")
      if [ -n "$pin" ]; then
        share=$((cores / p))
        run=(taskset -c "$(((i - 1) * share))-$((i * share - 1))" "${run[@]}")
      fi
      "${run[@]}" > "$S/$shape-$i.log" 2>&1 &
    done
    wait
    t1=$(date +%s%N)
    echo "==== $p processes x $j workers${pin:+, pinned}: $(((t1 - t0) / 1000000)) ms"
    grep -h -E "^done" "$S/$shape"-*.log
    python3 scripts/same-metrics.py "$S/prime" "$S/$shape" nightly | tail -1
  done
} > "$OUT/process-pool.log" 2>&1
cat "$OUT/process-pool.log"
