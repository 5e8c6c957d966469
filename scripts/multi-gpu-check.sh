#!/usr/bin/env bash
# Issue 24's checks on a machine with two or more GPUs, in one device call: the GPU tests (the
# two-GPU sweep test among them), then the nightly suite on one GPU and on every GPU, timed, and
# every run's metrics compared across the stores. Logs go to OUT: machine.txt, tests.log,
# sweeps.log.
# Usage: multi-gpu-check.sh DIR OUT, DIR the unpacked bundle of scripts/gpu-bundle.sh, run from
# the repository root (it reads suites/nightly.toml and scripts/same-metrics.py).
set -uo pipefail
DIR=${1:?bundle folder}
OUT=${2:?output folder}
mkdir -p "$OUT"
L="$DIR/lockstep"
{ nvidia-smi -L; nvidia-smi topo -m; nproc; } > "$OUT/machine.txt" 2>&1
"$DIR/gpu-check.sh" "$DIR" "$OUT" quick
status=$?
export LOCKSTEP_CACHE=/tmp/sweeps/cache
S=/tmp/sweeps
rm -rf "$S" && mkdir -p "$S"
sweep() { # NAME ARGS...: one timed `lockstep run` of the nightly suite into store $S/NAME
  local name=$1; shift
  echo "==== $name: lockstep run suites/nightly.toml $*"
  "$L" run suites/nightly.toml --store "$S/$name" "$@" 2>&1 | grep -v '^\[' | grep -v '^  [a-z0-9-]* s[0-9]'
}
{
  # The first sweep also trains the warm start into the cache the others reuse.
  sweep prime --device cuda
  # One process (the layout before worker processes), then the default: 2 processes per GPU
  # of 4 workers each.
  sweep one-j1 --device cuda:0 --jobs 1 --processes 1
  sweep all-j2 --device cuda --jobs 2 --processes 1
  sweep one-j4 --device cuda:0 --jobs 4 --processes 1
  sweep all-j8 --device cuda --jobs 8 --processes 1
  sweep one-default --device cuda:0
  sweep all-default --device cuda
  echo "==== two processes on one store, one per GPU, 4 workers each"
  start=$(date +%s.%N)
  "$L" run suites/nightly.toml --store "$S/procs" --device cuda:0 --jobs 4 --processes 1 > "$S/p0.log" 2>&1 &
  "$L" run suites/nightly.toml --store "$S/procs" --device cuda:1 --jobs 4 --processes 1 > "$S/p1.log" 2>&1 &
  wait
  end=$(date +%s.%N)
  python3 -c "print(f'both done in {$end - $start:.1f}s')"
  grep -h '^done in' "$S/p0.log" "$S/p1.log"
  grep -h -c ' start ' "$S/p0.log" "$S/p1.log"
  echo "==== same metrics as cuda:0 alone (one-j1)?"
  for s in prime all-j2 one-j4 all-j8 one-default all-default procs; do python3 scripts/same-metrics.py "$S/one-j1" "$S/$s" nightly || status=1; done
  echo "==== devices recorded (all-default)"
  python3 -c 'import collections, glob, json, sys
n = collections.Counter()
for f in glob.glob(sys.argv[1] + "/nightly/*/manifest.json"):
    m = json.load(open(f)); n[(m["device"], m["extra"].get("gpu"))] += 1
for k, v in sorted(n.items()): print(v, *k)' "$S/all-default"
  echo "==== cuda:1 faults 4 s into a sweep over both cards, in worker processes (the default)"
  LOCKSTEP_PLANT_FAULT=cuda:1 LOCKSTEP_PLANT_FAULT_AFTER=4 "$L" run suites/nightly.toml \
    --store "$S/fault" --device cuda > "$S/fault.log" 2>&1
  echo "exit $?"
  grep -E '^(done in|runs per device|error|warning|worker process|fault-injection)' "$S/fault.log"
  # Every run of cuda:0 ok and as on cuda:0 alone; cuda:1's failed naming cuda:1, or not run.
  python3 - "$S/fault" "$S/one-j1" <<'PY' || status=1
import collections, glob, json, pathlib, sys
import pyarrow.parquet as pq
fault, ref = pathlib.Path(sys.argv[1]) / "nightly", pathlib.Path(sys.argv[2]) / "nightly"
def scalars(run):
    t = pq.read_table(run / "scalars.parquet").to_pydict()
    return {k: v for k, v in t.items() if not k.startswith("perf/")}
n, bad = collections.Counter(), []
for f in sorted(fault.glob("*/manifest.json")):
    m = json.load(open(f)); run = f.parent
    n[(m["device"], m["status"])] += 1
    if m["device"] == "cuda:0" and (m["status"] != "ok" or scalars(run) != scalars(ref / run.name)):
        bad.append(f"{run.name}: {m['status']} on cuda:0, or other metrics than cuda:0 alone")
    if m["status"] == "failed" and "cuda:1" not in (m.get("error") or ""):
        bad.append(f"{run.name}: failed without naming cuda:1: {m.get('error')}")
for k, v in sorted(n.items()): print(v, *k)
print("\n".join(bad) or "cuda:0's runs all ok and as on cuda:0 alone; every failure names cuda:1")
sys.exit(1 if bad else 0)
PY
  echo "==== a device that is not visible"
  CUDA_VISIBLE_DEVICES=1 "$L" run suites/nightly.toml --store "$S/hidden" --device cuda:0,cuda:1; echo "exit $?"
} > "$OUT/sweeps.log" 2>&1
cat "$OUT/sweeps.log"
exit $status
