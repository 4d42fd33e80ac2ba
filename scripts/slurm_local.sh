#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the sweep's Slurm tests (tests/integration/test_sweep_slurm_cluster.py) and
# for trying `python launch/sweep.py --backend slurm` without a cluster.
#
#   bash scripts/slurm_local.sh up      # install Debian's slurm-wlm and munge if missing, write the config, start
#   bash scripts/slurm_local.sh down    # stop slurmd, slurmctld and munged; nothing of them is left running
#   bash scripts/slurm_local.sh status  # sinfo, and which daemons run
#
# Needs root (apt-get, daemons as root) on a Debian-like machine; no systemd: the daemons are started directly.
# The node is this machine with its CPUs and memory, no GPUs (GresTypes unset); one partition, `debug`, is the
# default. ProctrackType=proctrack/linuxproc and TaskPlugin=task/none need no cgroups; SlurmUser=root. There is no
# accounting database, so `sacct` does not work here (the sweep reads squeue and its run directories instead).
# State lives in /var/spool/slurm-local and logs in /var/log/slurm-local; `up` on a running cluster restarts it.
set -euo pipefail

STATE=/var/spool/slurm-local
LOGS=/var/log/slurm-local
CONF=/etc/slurm/slurm.conf

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

pids_of() {  # pids of a daemon binary, exact executable path match (never a broad pattern); Debian's
  local exe pid  # /usr/sbin/slurmctld is a link to slurmctld-wlm, which /proc/<pid>/exe names
  exe=$(readlink -f "$1")
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$exe" ] && echo "$pid"
  done
  return 0
}

stop_daemon() {  # SIGTERM, then SIGKILL after 10 s
  local exe=$1 pids i
  pids=$(pids_of "$exe")
  [ -z "$pids" ] && return 0
  kill $pids 2>/dev/null || true
  for i in $(seq 50); do
    pids=$(pids_of "$exe"); [ -z "$pids" ] && return 0; sleep 0.2
  done
  kill -9 $pids 2>/dev/null || true
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
      && command -v sbatch >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "installing slurm-wlm and munge needs root"
  echo "installing slurm-wlm and munge (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null \
    || die "apt-get install slurm-wlm munge failed (run 'apt-get update' first?)"
}

write_config() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))  # MB, leaving 1 GB to the system
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$LOGS"
  cat > "$CONF" <<EOF
# written by scripts/slurm_local.sh: a one-node cluster for tests
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
MinJobAge=3600
DefMemPerCPU=$(( mem / cpus ))
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  # the packages' own key, else a fresh one
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
}

up() {
  install_packages
  down quiet
  write_config
  runuser -u munge -- /usr/sbin/munged || /usr/sbin/munged --force
  /usr/sbin/slurmctld
  /usr/sbin/slurmd
  local i
  for i in $(seq 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      sinfo
      return 0
    fi
    sleep 1
  done
  sinfo || true
  tail -5 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 || true
  die "the node did not become idle in 60 s (logs in $LOGS)"
}

down() {
  stop_daemon /usr/sbin/slurmd
  stop_daemon /usr/sbin/slurmctld
  stop_daemon /usr/sbin/munged
  # jobs the daemons started and left behind: processes whose parent chain was slurmstepd
  stop_daemon /usr/sbin/slurmstepd
  rm -rf "$STATE/ctld"/* "$STATE/d"/* 2>/dev/null || true  # the next `up` starts with an empty queue
  [ "${1:-}" = quiet ] || echo "slurm_local.sh: stopped"
}

status() {
  for exe in /usr/sbin/munged /usr/sbin/slurmctld /usr/sbin/slurmd; do
    echo "$(basename $exe): $(pids_of $exe | tr '\n' ' ')"
  done
  sinfo 2>/dev/null || echo "sinfo: no controller"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) die "usage: bash scripts/slurm_local.sh up|down|status" ;;
esac
