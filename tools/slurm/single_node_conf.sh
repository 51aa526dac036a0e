#!/usr/bin/env bash
# Writes a slurm.conf for a one-node Slurm on this machine, with every state
# file, spool directory and log under DIR and every daemon on 127.0.0.1: for
# trying the sbatch scripts here and for tests/cli/slurm_test.sh. Not a
# cluster configuration (no cgroups, no accounting, oversubscribed cores).
#
# Usage: single_node_conf.sh DIR [options]  (prints DIR/slurm.conf's path)
#   --ctld-port P       slurmctld's port (default 6817)
#   --slurmd-port P     slurmd's port (default 6818)
#   --munge-socket S    munged's socket (default: the system's)
#   --cpus N            CPUs the node offers (default: the online CPUs)
#   --user U            the user the daemons run as (default: the current one)
# Then, as root (DIR/spool and DIR/state are created here):
#   export SLURM_CONF=DIR/slurm.conf
#   slurmctld -f "$SLURM_CONF" && slurmd -f "$SLURM_CONF"
#   sinfo   # the node turns idle within seconds
set -euo pipefail

die() { echo "single_node_conf.sh: $*" >&2; exit 2; }
[ $# -ge 1 ] || die "usage: single_node_conf.sh DIR [--ctld-port P] [--slurmd-port P] [--munge-socket S] [--cpus N] [--user U]"
dir=$(mkdir -p "$1" && cd "$1" && pwd)
shift
# (Not nproc: it follows OMP_NUM_THREADS.)
ctld_port=6817 slurmd_port=6818 munge_socket='' cpus=$(getconf _NPROCESSORS_ONLN) user=$(id -un)
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || die "$1 needs a value"
  case $1 in
    --ctld-port) ctld_port=$2 ;;
    --slurmd-port) slurmd_port=$2 ;;
    --munge-socket) munge_socket=$2 ;;
    --cpus) cpus=$2 ;;
    --user) user=$2 ;;
    *) die "unknown option '$1'" ;;
  esac
  shift 2
done

# slurmd finds its own NodeName entry by the short host name.
node=$(hostname -s)
mkdir -p "$dir/spool" "$dir/state"
auth_info=
[ -z "$munge_socket" ] || auth_info="AuthInfo=socket=$munge_socket"

cat >"$dir/slurm.conf" <<CONF
# Written by tools/slurm/single_node_conf.sh: one node, loopback only.
ClusterName=xirang-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
$auth_info
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: they need a writable cgroup tree, which containers often lack.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
# Cores are shared: more tasks than CPUs is allowed (as mpirun --oversubscribe).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# --cpus may exceed the hardware: the node then offers what the file says.
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
echo "$dir/slurm.conf"
