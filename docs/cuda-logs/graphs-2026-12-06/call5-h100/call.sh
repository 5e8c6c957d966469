#!/usr/bin/env bash
# Call 5 (3d42baf): a decode position queued op by op against its CUDA graph (bench decode, and
# cuda_rollout's graph test); where the batched nightly's host time goes (driver-call timing shim,
# GPU utilization); the sweep the issue describes (build d482fbb; its warm start trained
# beforehand on a CPU, carried) beside today's, on one machine.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
for b in d482; do xz -dc target/gpuz/old-$b.xz > /tmp/$b && chmod +x /tmp/$b; done
mkdir -p /tmp/shim && cp target/gpuz/shim/libcuda.so /tmp/shim/
mkdir -p /tmp/c-old && cp target/gpuz/ws-old/* /tmp/c-old/ 2>/dev/null
N=/tmp/b/lockstep
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
nproc >> $R/machine.txt
util() { nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm --format=csv,noheader -lms 100 > $R/util-$1.csv 2>&1 & UPID=$!; }
wall() { local a=$(date +%s.%N); "$@"; local rc=$?; local b=$(date +%s.%N); awk -v a=$a -v b=$b -v rc=$rc 'BEGIN{printf "wall %.2f s rc %d\n", b-a, rc}'; }
timeout 120 $N bench decode --device cuda --model small --recipes bf16,nvfp4-dq,mxfp8 --batch-runs 1,16 --seqs 128 --reps 30 > $R/decode-graph.log 2>&1; echo "rc $?" >> $R/decode-graph.log
echo "decode done at $(el) s" >> $R/times.txt
timeout 90 /tmp/b/cuda_rollout --test-threads 1 --nocapture > $R/cuda-rollout-test.log 2>&1; echo "rc $?" >> $R/cuda-rollout-test.log
echo "rollout test done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
{ echo "== new, nightly from an empty cache"; wall $N run suites/nightly.toml --device cuda --store /tmp/sn0 2>&1 | grep -E "done in|warm start" | tail -3; } > $R/new-runs.log 2>&1
for L in 1x2b16 1x1b16; do
  util shim-$L
  SHIM_OUT=$R/shim-$L.txt LD_LIBRARY_PATH=/tmp/shim timeout 60 $N bench sweep --device cuda --layouts $L > $R/sweep-shim-$L.log 2>&1
  kill $UPID
done
echo "shim done at $(el) s" >> $R/times.txt
util plain; timeout 90 $N bench sweep --device cuda --layouts 1x2b16,2x4:host > $R/sweep-plain.log 2>&1; kill $UPID
echo "plain sweep done at $(el) s" >> $R/times.txt
{ echo "== new, nightly, warm start cached, default layout"; wall $N run suites/nightly.toml --device cuda --store /tmp/sn1 2>&1 | grep -E "done in" | tail -2
  echo "== new, nightly, warm start cached, 8 one-run workers"; wall $N run suites/nightly.toml --device cuda --jobs 8 --batch-runs 1 --store /tmp/sn2 2>&1 | grep -E "done in" | tail -2; } >> $R/new-runs.log 2>&1
echo "new runs done at $(el) s" >> $R/times.txt
for b in d482; do
  left=$(( 540 - $(el) )); [ $left -lt 30 ] && break
  util $b; { echo "== $b, nightly, 8 workers, warm start cached"; LOCKSTEP_CACHE=/tmp/c-old wall timeout $left /tmp/$b run suites/nightly.toml --device cuda --jobs 8 --store /tmp/s-$b 2>&1 | grep -E "done in|warm start" | tail -3; } >> $R/old-$b.log 2>&1; kill $UPID
  echo "$b done at $(el) s" >> $R/times.txt
done
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
