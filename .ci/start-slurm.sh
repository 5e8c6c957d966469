#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine for tests/slurm.rs (Debian's slurmctld + slurmd +
# slurm-client, munge). Needs root (or passwordless sudo) and apt; safe to run again (it restarts
# nothing that is already up). Without systemd: the daemons are started directly.
# Prints one line saying what failed and exits non-zero when the cluster cannot come up; the Slurm
# integration test then skips with its own message.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "start-slurm: not root and no passwordless sudo; cannot install or start Slurm" >&2
    exit 1
  fi
fi

need=()
for b in slurmctld slurmd sbatch munged; do command -v "$b" >/dev/null 2>&1 || need+=("$b"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "start-slurm: installing Debian's slurm packages (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

NODE="$(hostname -s)"
CPUS=2
CONF_DIR=/etc/slurm
$SUDO mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm /run/munge /var/log/munge /var/lib/munge /etc/munge

# munge: one key, daemon as root (--force: this throwaway cluster runs everything as root).
if [ ! -s /etc/munge/munge.key ]; then
  $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
$SUDO chmod 0400 /etc/munge/munge.key
$SUDO chmod 0700 /etc/munge /var/lib/munge /var/log/munge
$SUDO chmod 0755 /run/munge
if ! munge -n >/dev/null 2>&1; then
  $SUDO chown root:root /etc/munge/munge.key /etc/munge /var/lib/munge /var/log/munge /run/munge
  $SUDO munged --force
fi

if [ -s "$CONF_DIR/slurm.conf" ] && ! grep -q '^ClusterName=lockstep$' "$CONF_DIR/slurm.conf"; then
  echo "start-slurm: $CONF_DIR/slurm.conf exists and is not the one this script writes; leaving that cluster alone" >&2
  exit 1
fi

# slurm.conf: one node, no cgroups, no accounting database (sacct is then unavailable; lockstep
# follows jobs with squeue and `scontrol show job`, kept for MinJobAge seconds after they end).
$SUDO tee "$CONF_DIR/slurm.conf" >/dev/null <<EOF
ClusterName=lockstep
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
KillWait=5
InactiveLimit=0
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

if ! scontrol ping 2>/dev/null | grep -q 'is UP'; then
  $SUDO slurmctld
fi
alive() { [ -s "$1" ] && $SUDO kill -0 "$($SUDO cat "$1")" 2>/dev/null; }
if ! alive /run/slurm/slurmd.pid; then
  $SUDO slurmd
fi

for _ in $(seq 1 60); do
  state="$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null | head -1 || true)"
  case "$state" in
    idle|mix|alloc) echo "start-slurm: node $NODE is $state"; sinfo; exit 0 ;;
    drain*|down*)
      $SUDO scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
echo "start-slurm: node $NODE did not become idle within 60 s (state: ${state:-none}); see /var/log/slurm/slurmctld.log and slurmd.log" >&2
exit 1
