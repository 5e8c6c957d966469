#!/usr/bin/env bash
# Call 5 (3fab747): 6x32x100 at batches of 16 (default) and 32.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
xz -dc target/gpuz/sym.xz > /tmp/new && chmod +x /tmp/new
S6=docs/cuda-logs/export-2026-12-05/call4-h100/sweep6x32.toml
timeout 560 /tmp/new bench sweep $S6 --device cuda --layouts 1x2b32,1x2b16,3x1b32 > $R/sweep6x32.log 2>&1
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
