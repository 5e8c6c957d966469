#!/usr/bin/env bash
# Build what a GPU machine needs for issue 7's checks (it has no cargo), here:
# target/gpuz/bundle.txz holds b/lockstep, one binary per GPU test file (b/cuda_*, and
# b/model_devices, whose bodies run on every device), a copy of
# tests/golden and scripts/gpu-check.sh. Carry target/gpuz to the device (xz keeps it under the
# device's 64 MiB carry limit) and run there:
#   tar xJf target/gpuz/bundle.txz -C /tmp && /tmp/b/gpu-check.sh /tmp/b "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
# cuda_emulator checks the emulator itself and skips on a GPU: it is left out.
tests=$(ls tests/cuda_*.rs tests/model_devices.rs | xargs -n1 basename | sed 's/\.rs$//' |
  grep -vx cuda_emulator)
# The fault-injection feature adds the sweep workers' fault hook (multi-gpu-check.sh uses it).
cargo build --release --features fault-injection
args=()
for t in $tests; do args+=(--test "$t"); done
cargo test --release --features fault-injection --no-run "${args[@]}" 2>&1 | grep Executable
rm -rf target/gpuz/b && mkdir -p target/gpuz/b
cp target/release/lockstep target/gpuz/b/
for t in $tests; do
  # The newest binary of that test (cargo keeps older hashes around).
  cp "$(ls -t target/release/deps/"$t"-* | grep -v '\.d$' | head -1)" "target/gpuz/b/$t"
done
strip target/gpuz/b/*
cp -r tests/golden target/gpuz/b/golden
cp scripts/gpu-check.sh scripts/multi-gpu-check.sh target/gpuz/b/
# The test binaries look for tests/golden under the folder they were built in.
pwd > target/gpuz/b/built_in
rm -f target/gpuz/bundle.tgz
tar cJf target/gpuz/bundle.txz -C target/gpuz b
rm -rf target/gpuz/b
ls -la target/gpuz/bundle.txz
