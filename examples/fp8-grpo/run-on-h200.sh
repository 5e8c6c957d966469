#!/usr/bin/env bash
# Everything one call on the GPU machine runs, from the repository root:
#
#   bash examples/fp8-grpo/run-on-h200.sh OUTDIR /path/to/lockstep [extra nightly flags...]
#
# 1. checks that FP8 torch._scaled_mm (E4M3, rowwise scales) matches a BF16 matmul within FP8
#    tolerance and its dequantized FP32 product within BF16 rounding (the scale convention);
# 2. `lockstep nightly examples/fp8-grpo/suite.toml --seeds auto`: bf16 and fp8 GRPO runs through
#    the command engine, seeds in batches until the sequential procedure decides fp8 on reward;
# 3. leaves under OUTDIR: run-on-h200.log (all output), fp8-check.txt, verdict/ (verdict.json,
#    summary.md, junit.xml, compare.json), reports/ (the HTML report and its PNGs), png/ (the PNGs
#    alone), runs/<run-id>/ (each run's manifest, launcher logs, run.json and TensorBoard file) and
#    store/ (lockstep's run store; STORE=DIR puts it elsewhere).
#
# Exit code: lockstep nightly's (0 pass or inconclusive, 1 regression, 2 error), or non-zero when
# the FP8 check fails (then nothing is trained). Sized to end in about 2-4 minutes on one H200.
set -euo pipefail
export PYTHONUNBUFFERED=1

if [[ $# -lt 2 ]]; then
  echo "usage: $0 OUTDIR LOCKSTEP_BINARY [extra lockstep nightly flags]" >&2
  exit 2
fi
OUT=$1
LOCKSTEP=$2
shift 2
PY=${PYTHON:-python3}
JOBS=${JOBS:-6}
MAX_SEEDS=${MAX_SEEDS:-12}
STORE=${STORE:-}
SUITE=examples/fp8-grpo/suite.toml

[[ -f $SUITE ]] || { echo "run from the repository root ($SUITE not found in $PWD)" >&2; exit 2; }
[[ -x $LOCKSTEP ]] || { echo "$LOCKSTEP is not an executable lockstep binary" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOCKSTEP=$(cd "$(dirname "$LOCKSTEP")" && pwd)/$(basename "$LOCKSTEP")
STORE=${STORE:-$OUT/store}
exec > >(tee -a "$OUT/run-on-h200.log") 2>&1
start=$SECONDS

echo "== $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi -L || true
"$PY" -c 'import torch, tensorboard; c = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", torch.version.cuda, "tensorboard", tensorboard.__version__, "device", torch.cuda.get_device_name(0) if c else "none", torch.cuda.get_device_capability(0) if c else "")'
"$LOCKSTEP" --version

echo "== FP8 check: torch._scaled_mm rowwise vs BF16"
"$PY" examples/fp8-grpo/grpo.py --check-fp8 --device cuda | tee "$OUT/fp8-check.txt"

echo "== suite"
"$LOCKSTEP" suite check "$SUITE"
"$LOCKSTEP" suite show "$SUITE" --argv > "$OUT/suite-argv.txt"
head -n 12 "$OUT/suite-argv.txt"

echo "== one run by hand first (fails fast, before the pool starts 6 at a time)"
"$PY" examples/fp8-grpo/grpo.py --precision fp8 --seed 99 --steps 3 --out "$OUT/smoke-fp8" --device cuda \
  --digits 2 --d-model 128 --layers 4 --heads 4 --d-ff 512 --prompts 32 --group 8 --sft-steps 20 --threads 2

echo "== lockstep nightly (--seeds auto up to $MAX_SEEDS seeds, $JOBS jobs)"
rc=0
timeout --signal=TERM --kill-after=30 360 \
  "$LOCKSTEP" nightly "$SUITE" --seeds auto --min-seeds 3 --max-seeds "$MAX_SEEDS" --batch 3 --jobs "$JOBS" \
  --store "$STORE" --out "$OUT/verdict" --reports "$OUT/reports" --baselines "$OUT/no-baselines" \
  "$@" || rc=$?
echo "== lockstep nightly exit code $rc after $((SECONDS - start)) s"

suite_dir="$STORE/fp8-grpo-h200"
[[ -f $suite_dir/compare.json ]] && cp "$suite_dir/compare.json" "$OUT/verdict/" || true
mkdir -p "$OUT/runs" "$OUT/png"
for run in "$suite_dir"/*/; do
  [[ -f $run/manifest.json ]] || continue
  id=$(basename "$run")
  mkdir -p "$OUT/runs/$id"
  cp "$run"/manifest.json "$run"/stdout.log "$run"/stderr.log "$OUT/runs/$id/" 2>/dev/null || true
  cp "$run"/out/run.json "$run"/out/events.out.tfevents.* "$OUT/runs/$id/" 2>/dev/null || true
done
find "$OUT/reports" -name '*.png' -exec cp {} "$OUT/png/" \; 2>/dev/null || true
echo "== $(ls "$OUT/runs" | wc -l) runs, $(ls "$OUT/png" | wc -l) PNGs; summary:"
cat "$OUT/verdict/summary.md" 2>/dev/null || echo "(no summary.md)"
for f in "$OUT"/runs/*/run.json; do
  "$PY" - "$f" <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['precision']:5s} seed {r['seed']:2d}: warm start {r['warm_start_steps']} steps acc {r['warm_start_greedy_accuracy']:.3f}"
      f" -> greedy acc {r['final_greedy_accuracy']:.3f}, {r['wall_s']:.1f} s")
EOF
done
echo "== done in $((SECONDS - start)) s; exit $rc"
exit "$rc"
