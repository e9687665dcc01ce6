#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for the `--slurm` tests (and for trying `rl --slurm` without a
# cluster). Idempotent: installs slurm-wlm + munge if missing (apt, as root), writes /etc/slurm/slurm.conf for
# this host, starts munged, slurmctld and slurmd, and waits until `sinfo` shows the node idle.
#   sudo bash scripts/slurm_cluster.sh            # then: sbatch / srun / squeue / scontrol show job N
#   bash scripts/slurm_cluster.sh --no-install    # start only (exit 1 when Slurm is not installed)
# Process tracking is linuxproc and task binding none, so it needs no cgroups (works in containers). Finished
# jobs stay visible to `scontrol show job` for an hour (MinJobAge): there is no accounting database (sacct).
set -euo pipefail

INSTALL=1
[[ "${1:-}" == "--no-install" ]] && INSTALL=0
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "slurm_cluster.sh: needs root (or passwordless sudo) to install and start the Slurm daemons" >&2
    exit 1
  fi
fi

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n 1; }

if command -v sinfo >/dev/null && [[ "$(node_state)" =~ ^(idle|mixed|allocated) ]]; then
  echo "slurm_cluster.sh: cluster already up ($(sinfo -h -N -o '%N %T'))"
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [[ $INSTALL -eq 0 ]]; then
    echo "slurm_cluster.sh: slurm-wlm is not installed (run without --no-install, as root)" >&2
    exit 1
  fi
  command -v apt-get >/dev/null || { echo "slurm_cluster.sh: no apt-get to install slurm-wlm" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge: the key, its directories, the daemon (as user munge).
$SUDO mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
$SUDO chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
$SUDO chmod 0400 /etc/munge/munge.key
$SUDO chmod 0755 /run/munge
if ! pgrep -u munge -x munged >/dev/null; then
  $SUDO runuser -u munge -- /usr/sbin/munged
fi

# slurm.conf for this host: CPUs, sockets and memory as slurmd detects them.
HOST=$(hostname -s)
NODE_LINE=$(slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]*/NodeName=$HOST/")
$SUDO mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
CONF=$(cat <<EOF
# Written by prime-rl scripts/slurm_cluster.sh: a one-node test cluster.
ClusterName=prime-rl-test
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=10
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
$NODE_LINE State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
)
if [[ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$CONF" ]]; then
  echo "$CONF" | $SUDO tee /etc/slurm/slurm.conf >/dev/null
  # A daemon that read an older file must start again.
  for pidfile in /run/slurmctld.pid /run/slurmd.pid; do
    [[ -s $pidfile ]] && $SUDO kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 2
fi
pgrep -x slurmctld >/dev/null || $SUDO slurmctld
pgrep -x slurmd >/dev/null || $SUDO slurmd

for _ in $(seq 60); do
  state=$(node_state)
  case "$state" in
    idle*|mixed*|allocated*) echo "slurm_cluster.sh: cluster up ($(sinfo -h -N -o '%N %T'))"; exit 0 ;;
    down*|drain*) $SUDO scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "slurm_cluster.sh: node not idle after 60 s (state: ${state:-none}); see /var/log/slurm/*.log" >&2
exit 1
