#!/usr/bin/env bash
# The nightly suite's wall time on a GPU machine (issue 7), next to the same suite on that machine's
# CPU cores alone (each with its own empty cache, so both include the warm start).
# Usage: scripts/gpu-nightly.sh BIN OUT [JOBS [DEVICES]]; BIN is a (stripped) lockstep binary,
# DEVICES the --device values to time (default "cuda cpu").
set -uo pipefail
BIN=${1:?lockstep binary}
OUT=${2:?output folder}
JOBS=${3:-8}
DEVICES=${4:-cuda cpu}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } | tee "$OUT/machine.txt"
for dev in $DEVICES; do
  start=$(date +%s)
  LOCKSTEP_CACHE=/tmp/ls-cache-$dev "$BIN" run suites/nightly.toml --device $dev --jobs "$JOBS" \
    --store /tmp/ls-runs-$dev > "$OUT/nightly_$dev.log" 2>&1
  echo "nightly on $dev, $JOBS workers: $(( $(date +%s) - start )) s (warm start included)" | tee -a "$OUT/machine.txt"
  tail -2 "$OUT/nightly_$dev.log"
done
