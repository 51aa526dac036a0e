#!/usr/bin/env bash
# Starts a Slurm on a test cluster of tools/cluster.sh: munged and
# slurmctld on node 0, one slurmd on every node (NodeName = the node's
# host name, NodeAddr = its address), all inside the nodes' namespaces, so
# `tools/cluster.sh down` stops them with everything else. Waits until
# every node is idle; prints the slurm.conf's path.
#
#   tools/cluster.sh up 2 /tmp/c
#   conf=$(tools/slurm/on_cluster.sh /tmp/c)
#   tools/cluster.sh exec /tmp/c 0 env SLURM_CONF=$conf sbatch --nodes=2 tools/slurm/train.sbatch ...
#   tools/cluster.sh down /tmp/c
#
# State, spool directories and logs go under DIR/slurm (munged's socket
# too: DIR's path must stay under about 80 characters, a unix socket's
# limit). Not a production configuration: no cgroups, no accounting, cores
# oversubscribed (as tools/slurm/single_node_conf.sh). Exits 77 with the
# reason when the Slurm or munge programs are missing or cannot start.
set -euo pipefail
die() { echo "on_cluster.sh: $*" >&2; exit 2; }
skip() { echo "on_cluster.sh: $*" >&2; exit 77; }
[ $# = 1 ] || die "usage: on_cluster.sh CLUSTER_DIR"
dir=$(cd "$1" && pwd)
cluster=$(cd "$(dirname "$0")/.." && pwd)/cluster.sh
[ -f "$dir/cluster.env" ] || die "'$dir' holds no cluster (tools/cluster.sh up N DIR)"
for tool in munged mungekey slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (munge, slurmctld, slurmd, slurm-client)"
done
s=$dir/slurm
mkdir -p "$s/state" "$s/spool" && mkdir -m 700 "$s/munge"
sock=$s/munge/munge.socket
[ ${#sock} -lt 100 ] || die "munged's socket path '$sock' is too long for a unix socket: use a shorter DIR"

# ctl NAME: the first node's name; every node's "NAME ADDRESS" from DIR/nodes.
read -r ctl ctl_addr _ <"$dir/nodes"
cpus=$(getconf _NPROCESSORS_ONLN)
[ "$cpus" -ge 2 ] || cpus=2
{
  cat <<CONF
# Written by tools/slurm/on_cluster.sh for the test cluster in $dir.
ClusterName=xirang-test
SlurmctldHost=$ctl($ctl_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool/%n
SlurmctldPidFile=$s/slurmctld.pid
SlurmdPidFile=$s/slurmd.%n.pid
SlurmctldLogFile=$s/slurmctld.log
SlurmdLogFile=$s/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
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
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
CONF
  while read -r name addr _; do
    echo "NodeName=$name NodeAddr=$addr CPUs=$cpus State=UNKNOWN"
  done <"$dir/nodes"
  echo "PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} >"$s/slurm.conf"
export SLURM_CONF=$s/slurm.conf

mungekey --create --keyfile="$s/munge/munge.key" >"$s/munged.log" 2>&1 || skip "mungekey failed: $(cat "$s/munged.log")"
"$cluster" exec "$dir" 0 munged --foreground --force --key-file="$s/munge/munge.key" --socket="$sock" \
  --pid-file="$s/munge/munged.pid" --seed-file="$s/munge/munged.seed" --log-file="$s/munged.log" \
  >>"$s/munged.log" 2>&1 &
pids=($!)
"$cluster" exec "$dir" 0 slurmctld -D -f "$SLURM_CONF" >"$s/slurmctld.out" 2>&1 &
pids+=($!)
# slurmd needs the cgroup tree, which `ip netns exec` hides when it mounts
# the node's own /sys: mount this machine's hierarchies again in the node's
# (private) mount namespace, as /proc/mounts lists them.
cgroups=$(awk '$2 ~ "^/sys/fs/cgroup" && ($3 == "tmpfs" || $3 ~ "^cgroup") {
  printf "mkdir -p %s && mount -t %s -o %s %s %s && ", $2, $3, $4, $1, $2 }' /proc/mounts)
# Each slurmd reads its own copy of slurm.conf, beside an mpi.conf that
# gives the node's PMIx clients a directory of their own: the default,
# /tmp/spmix_appdir_UID_STEP, is one directory for every node of a step
# here, where the nodes share /tmp.
while read -r name _; do
  mkdir -p "$s/spool/$name" "$s/$name/pmix"
  cp "$SLURM_CONF" "$s/$name/slurm.conf"
  echo "PMIxCliTmpDirBase=$s/$name/pmix" >"$s/$name/mpi.conf"
  "$cluster" exec "$dir" "$name" sh -c "${cgroups}exec \"\$@\"" slurmd slurmd -D -N "$name" -f "$s/$name/slurm.conf" \
    >"$s/slurmd.$name.out" 2>&1 &
  pids+=($!)
done <"$dir/nodes"

nodes=$(wc -l <"$dir/nodes")
for _ in $(seq 60); do
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || skip "a daemon cannot start here: $(tail -q -n 3 "$s"/*.out "$s"/*.log 2>/dev/null | tr '\n' ' ' | cut -c1-600)"
  done
  idle=$("$cluster" exec "$dir" 0 sinfo --noheader --Node --format=%T 2>/dev/null | grep -c '^idle$' || true)
  [ "$idle" = "$nodes" ] && { echo "$SLURM_CONF"; exit 0; }
  sleep 0.5
done
skip "$idle of $nodes nodes idle 30 s after the daemons started: $(tail -q -n 3 "$s"/*.log "$s"/*.out 2>/dev/null | tr '\n' ' ' | cut -c1-600)"
