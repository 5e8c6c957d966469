#!/usr/bin/env bash
# GPU checks and timings for issue 7, in one call on a GPU machine (see docs/cuda.md).
# Usage: scripts/cuda-check.sh DIR OUT, where DIR holds a (stripped) `lockstep` binary, the
# `cuda_quantizer` test binary as `cq` and a copy of tests/golden as `golden`; logs go to OUT.
# The test binary looks for the golden files under the path it was built in ($BUILT, baked in
# by cargo as CARGO_MANIFEST_DIR), so they are copied there first.
set -uo pipefail
DIR=${1:?binary folder}
OUT=${2:?output folder}
BUILT=${BUILT:-/work/wt-cuda}
mkdir -p "$BUILT/tests" "$OUT"
cp -r "$DIR/golden" "$BUILT/tests/golden"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/smi.txt"
echo "== tests"
"$DIR/cq" --test-threads 1 --nocapture 2>&1 | tee "$OUT/tests.log"
echo "== bench quantize"
for i in 1 2; do "$DIR/lockstep" bench quantize --device cuda --size "${SIZE:-16384}" 2>&1 | tee -a "$OUT/bench_quantize.log"; done
echo "== bench step"
for d in cuda cpu; do
  "$DIR/lockstep" bench step --device "$d" --model small --steps "${STEPS:-3}" 2>&1 | tee -a "$OUT/bench_step.log"
done
echo "== run-one: GPU run-to-run and CPU-vs-GPU drift (same cached BF16 warm start, same seed)"
W=$(mktemp -d)
for r in cpu cuda cuda2; do
  d=${r%2}
  "$DIR/lockstep" run-one --model "${MODEL:-tiny}" --task add:2 --recipe "${RECIPE:-nvfp4-dq}" --seed 0 \
    --steps "${RUN_STEPS:-20}" --device "$d" --cache "$W/cache" --out "$W/$r" > "$W/$r.log" 2>&1
  echo "$r: $(tail -1 "$W/$r.log")"
done
python3 - "$W" <<'PY' 2>&1 | tee "$OUT/drift.txt"
import csv, math, sys
w = sys.argv[1]
def load(r):
    rows = list(csv.DictReader(open(f"{w}/{r}/scalars.csv")))
    return {k: [float(x[k]) if x[k] else math.nan for x in rows] for k in rows[0]}
cpu, g1, g2 = load("cpu"), load("cuda"), load("cuda2")
keys = [k for k in g1 if not k.startswith("perf/") and k != "step"]
same = all(str(g1[k]) == str(g2[k]) for k in keys)
print(f"cuda run 1 vs run 2, {len(keys)} metrics x {len(g1['step'])} steps: {'identical' if same else 'DIFFERENT'}")
for k in ["rollout/raw_reward", "train/train_rollout_kl", "train/grad_norm", "train/loss"]:
    if k in cpu:
        d = [abs(a - b) for a, b in zip(cpu[k], g1[k])]
        first = next((i for i, x in enumerate(d) if x != 0), None)
        print(f"{k:<26} cpu vs cuda: max |diff| {max(d):.3g}, first differing step {first}")
PY
