#!/usr/bin/env bash
# Builds lockstep's CUDA emulator into OUT (default target/cuda-emu): one shared library under the
# names cudarc loads. Use: LD_LIBRARY_PATH=$PWD/target/cuda-emu cargo test --test cuda_ops
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-target/cuda-emu}
mkdir -p "$OUT"
g++ -std=c++17 -O3 -march=native -g -fPIC -shared -fvisibility=hidden -Wall -Wno-unused-parameter \
  -DEMU_DIR="\"$HERE\"" -o "$OUT/libcudaemu.so" "$HERE/runtime.cpp" -ldl -lpthread
for name in libcuda.so libcuda.so.1 libnvrtc.so libcublas.so; do
  ln -sf libcudaemu.so "$OUT/$name"
done
echo "$OUT"
