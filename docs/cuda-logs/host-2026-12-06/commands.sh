#!/usr/bin/env bash
# What made this folder (build 8e9362d, this machine, no GPU: the CUDA emulator in its skip-work
# mode, scripts/cuda-emu/README.md). profile15.toml is docs/cuda-logs/profile-2026-12-06's: one
# 15-run batch of the nightly's three recipes at --batch-runs 16; p15s4.toml the same with 4 steps,
# so (4-step counts - 2-step counts) / 2 is a step's.
set -euo pipefail
bash scripts/cuda-emu/build.sh && bash scripts/host-profile/build.sh
export LD_LIBRARY_PATH=$PWD/target/cuda-emu LOCKSTEP_CUDA_EMU_CACHE=$PWD/target/cuda-emu/kernels \
  LOCKSTEP_CUDA_EMU_SKIP_WORK=1 LOCKSTEP_CUDA_EMU_RUN_KERNELS=router_topk,route_slots,router_replay \
  LOCKSTEP_CUDA_EMU_FILL=0 LOCKSTEP_CACHE=/tmp/hpc
P=docs/cuda-logs/profile-2026-12-06/profile15.toml
sed 's/^steps = 2/steps = 4/; s/name = "profile15"/name = "p15s4"/' $P > /tmp/p15s4.toml
# calls-2steps.txt, calls-4steps.txt: driver and cuBLAS calls, kernels by name
for f in $P /tmp/p15s4.toml; do
  LOCKSTEP_CUDA_EMU_CALLS=/tmp/calls-$(basename $f) target/release/lockstep run $f --device cuda --jobs 1 --batch-runs 16 --store /tmp/s-$(basename $f) --force
done
# alloc-sites.txt, copy-sites.txt, memset-sites.txt: each call counted by its caller
for w in alloc copy memset; do
  LOCKSTEP_CUDA_EMU_RAISE_ON=$w HOSTPROF_US=0 HOSTPROF_OUT=/tmp/ev-$w LD_PRELOAD=target/host-profile/hostprof.so \
    target/release/lockstep run /tmp/p15s4.toml --device cuda --jobs 1 --batch-runs 16 --store /tmp/s-ev-$w --force
  scripts/host-profile/report.py /tmp/ev-$w.PID target/release/lockstep --top 25
done
# host-code-nightly.txt: the nightly's host CPU time outside the (emulated) driver
HOSTPROF_OUT=/tmp/hpn LD_PRELOAD=target/host-profile/hostprof.so target/release/lockstep run suites/nightly.toml --device cuda --store /tmp/s-n
scripts/host-profile/report.py /tmp/hpn.PID target/release/lockstep --top 30 --exclude cuda-emu
