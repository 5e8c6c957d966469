#!/usr/bin/env bash
# Builds a timing shim for the CUDA driver into OUT (default target/driver-time): a libcuda.so that
# forwards every driver entry point cudarc can load to the real libcuda.so.1 and adds up the host
# time spent in each; at exit it appends a table (calls, total ms, us a call) to $SHIM_OUT (else
# stderr). cudarc opens "libcuda.so" first, so putting OUT first on the library path interposes it:
#   LD_LIBRARY_PATH=OUT SHIM_OUT=times.txt lockstep bench sweep --device cuda --layouts 1x1b16
# Every entry point is forwarded as twelve integer-register arguments, which holds for the driver
# API's pointer and integer parameters; the three that take a float by value are left out.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-target/driver-time}
mkdir -p "$OUT"
SYS=$(ls -d ~/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
grep -oP "pub unsafe fn \Kcu\w+(?=\()" "$SYS" | sort -u |
  grep -v -x -e cuParamSetf -e cuTexRefSetMipmapLevelBias -e cuTexRefSetMipmapLevelClamp > "$OUT/names.txt"
python3 "$HERE/gen.py" "$OUT/names.txt" > "$OUT/shim.c"
gcc -O2 -shared -fPIC -o "$OUT/libcuda.so" "$OUT/shim.c" -ldl
echo "$OUT/libcuda.so"
