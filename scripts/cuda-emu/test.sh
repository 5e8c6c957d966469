#!/usr/bin/env bash
# Runs lockstep's GPU tests on the CUDA emulator, without a GPU: builds the emulator, then the
# GPU test files (tests/cuda_*.rs, model_devices) with it first on the library path. A pass here
# is not a GPU verification (README.md beside this says what the emulator does not model).
#
#   scripts/cuda-emu/test.sh            every GPU test file but cuda_sweeps
#   scripts/cuda-emu/test.sh --all      also cuda_sweeps on two emulated devices (builds lockstep
#                                       with --features fault-injection, which its fault needs)
#   LOCKSTEP_CUDA_EMU_REVERSE=1 ...     blocks and threads run last to first
set -euo pipefail
cd "$(dirname "$0")/../.."
LIB=$(bash scripts/cuda-emu/build.sh target/cuda-emu)
export LD_LIBRARY_PATH="$PWD/$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LOCKSTEP_CUDA_EMU_CACHE="$PWD/target/cuda-emu/kernels"
mkdir -p "$LOCKSTEP_CUDA_EMU_CACHE"
tests=()
for f in tests/cuda_*.rs tests/model_devices.rs; do
  name=$(basename "$f" .rs)
  [ "$name" = cuda_sweeps ] && continue
  tests+=(--test "$name")
done
cargo test --no-fail-fast "${tests[@]}" -- --test-threads "${EMU_TEST_THREADS:-2}"
if [ "${1:-}" = --all ]; then
  LOCKSTEP_CUDA_EMU_DEVICES=2 cargo test --features fault-injection --test cuda_sweeps
fi
