#!/usr/bin/env bash
# Builds the host-time sampler (sampler.c) into OUT (default target/host-profile/hostprof.so).
# The GPU machines have no perf, gdb or strace; preloading this samples every thread's stack each
# millisecond of the process's CPU time and writes them at exit:
#   HOSTPROF_OUT=prof LD_PRELOAD=OUT/hostprof.so lockstep run suites/nightly.toml --device cuda
#   scripts/host-profile/report.py prof.PID target/release/lockstep   # the same build, unstripped
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-target/host-profile}
mkdir -p "$OUT"
gcc -O2 -shared -fPIC -o "$OUT/hostprof.so" "$HERE/sampler.c"
echo "$OUT/hostprof.so"
