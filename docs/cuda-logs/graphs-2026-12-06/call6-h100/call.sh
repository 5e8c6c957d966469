#!/usr/bin/env bash
# Call 6 (the stop's final code): every GPU test file of the bundle (cuda_rollout's graph test
# included); the nightly's metrics through the build before (02d0ed1) and this one; bench decode
# at the nightly's and the step benchmark's rollout sizes.
set -u
OUT=$1; R=$OUT/r; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/old-02d0.xz > /tmp/old && chmod +x /tmp/old
N=/tmp/b/lockstep; O=/tmp/old
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R" quick > $R/tests-summary.log 2>&1
echo "tests done at $(el) s" >> $R/times.txt
export LOCKSTEP_CACHE=/tmp/c
rm -rf /tmp/so /tmp/sn /tmp/bl
$O run suites/nightly.toml --device cuda --store /tmp/so 2>&1 | grep "done in" > $R/metrics.log
$N run suites/nightly.toml --device cuda --store /tmp/sn 2>&1 | grep "done in" >> $R/metrics.log
$N baseline save --suite suites/nightly.toml --store /tmp/so --baselines /tmp/bl >> $R/metrics.log 2>&1
$N baseline diff --suite suites/nightly.toml --store /tmp/sn --baselines /tmp/bl >> $R/metrics.log 2>&1; echo "diff rc $?" >> $R/metrics.log
echo "metrics done at $(el) s" >> $R/times.txt
timeout 100 $N bench decode --device cuda --model small --recipes bf16,nvfp4-dq --batch-runs 1,16,30 --seqs 128 --reps 30 > $R/decode-graph.log 2>&1; echo "rc $?" >> $R/decode-graph.log
timeout 60 $N bench decode --device cuda --model small --recipes bf16 --batch-runs 1,16 --seqs 256 --reps 30 >> $R/decode-graph.log 2>&1; echo "rc $?" >> $R/decode-graph.log
echo "all done at $(el) s" >> $R/times.txt
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
