#!/usr/bin/env bash
# Call 4 (02d0ed1, the final head): GPU tests of the bundle; the step benchmark; the nightly
# in the default layout against the build before (0a1c4fb), metrics through both builds.
set -u
OUT=$1
R=$OUT/r; mkdir -p $R
tar xJf target/gpuz/bundle.txz -C /tmp
xz -dc target/gpuz/old.xz > /tmp/old && chmod +x /tmp/old
N=/tmp/b/lockstep; O=/tmp/old
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/machine.txt
bash /tmp/b/gpu-check.sh /tmp/b "$R" quick > $R/tests-summary.log 2>&1
export LOCKSTEP_CACHE=/tmp/c
timeout 90 $N bench step --device cuda --model small --steps 3 --recipe bf16 --batch-runs 1,16 > $R/step.log 2>&1
{ echo "== new"; timeout 60 $N bench sweep --device cuda --layouts 1x2b16; echo "== old (0a1c4fb)"; timeout 60 $O bench sweep --device cuda --layouts 1x2b16; } > $R/sweep.log 2>&1
rm -rf /tmp/so /tmp/sn /tmp/bl
$O run suites/nightly.toml --device cuda --store /tmp/so 2>&1 | grep "done in" > $R/metrics.log
$N run suites/nightly.toml --device cuda --store /tmp/sn 2>&1 | grep "done in" >> $R/metrics.log
$N baseline save --suite suites/nightly.toml --store /tmp/so --baselines /tmp/bl >> $R/metrics.log 2>&1
$N baseline diff --suite suites/nightly.toml --store /tmp/sn --baselines /tmp/bl >> $R/metrics.log 2>&1; echo "diff rc $?" >> $R/metrics.log
tar cJf $OUT/results.txz -C $OUT r && rm -rf $R
