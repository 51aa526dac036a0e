#!/usr/bin/env bash
# A test cluster on one machine: N nodes, each a network namespace with its
# own address, host name and processes, joined by a bridge, for running
# multi-node jobs (mpirun over TCP, Slurm) where there is one kernel.
#
#   tools/cluster.sh run 2 -- CMD...    up, CMD with XR_CLUSTER=DIR, down (also on failure or a signal)
#   tools/cluster.sh up N DIR           make N nodes, their state in DIR (printed)
#   tools/cluster.sh down DIR           stop every process in the nodes, remove all that up made
#   tools/cluster.sh exec DIR I CMD...  CMD on node I (index 0.. or name), under the node's host name
#   tools/cluster.sh mpirun DIR ARGS... mpirun on node 0 over every node's slots (DIR/hostfile)
#   tools/cluster.sh leftovers [PREFIX] what is still there of PREFIX (all "xr<pid>" clusters without it)
#   tools/cluster.sh sweep              down every cluster whose owner process has gone (after a kill -9)
#
# Layout (nothing is added to the machine's own network namespace):
#   PREFIXsw   the switch: bridge br0 and one veth end per node
#   PREFIXnI   node I: eth0 = 10.213.0.(I+1)/24, lo up, host name PREFIXnI
#              (a UTS namespace per command), /etc/netns/PREFIXnI/hosts
#              naming every node (ip netns exec mounts it over /etc/hosts)
# PREFIX is "xr" and the pid of the cluster's owner (up's caller, or
# $XR_CLUSTER_OWNER; one cluster an owner): parallel runs never share a
# name, `sweep` finds clusters whose owner is gone, and every run can use
# the same private range, since its bridge is its own.
# XR_CLUSTER_CPUS="0 0-1" (one list a node) confines each node's commands
# to those CPUs (taskset), as nodes of different sizes; XR_CLUSTER_SLOTS
# (default 2) is each node's slots in the hostfile.
# DIR holds: cluster.env (PREFIX, NODES), nodes ("NAME ADDRESS [CPUS]" a
# line), hostfile (NAME slots=SLOTS), rsh (the agent Open MPI runs instead
# of ssh: `rsh HOST COMMAND...` runs COMMAND on HOST's node).
#
# Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2, unshare.
# `up` exits 77 with the reason when the machine does not allow namespaces.
set -euo pipefail
self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
subnet=10.213.0
slots=${XR_CLUSTER_SLOTS:-2}

die() { echo "cluster.sh: $*" >&2; exit 2; }
usage() { sed -n '6,12p' "$self" | sed 's/^# //' >&2; exit 2; }

# load DIR: PREFIX and NODES of the cluster whose state is in DIR.
load() {
  [ -f "$1/cluster.env" ] || die "'$1' holds no cluster (no cluster.env)"
  # shellcheck disable=SC1091
  . "$1/cluster.env"
}

# node_ns DIR I|NAME: the node's namespace name.
node_ns() {
  load "$1"
  case $2 in
    [0-9]*) [ "$2" -lt "$NODES" ] || die "no node $2 (the cluster has $NODES)"; echo "${PREFIX}n$2" ;;
    *) grep -q "^$2 " "$1/nodes" || die "no node named '$2' in $1/nodes"; echo "$2" ;;
  esac
}

# remove PREFIX: every process in its namespaces, the namespaces (with their
# veths and bridge), their hosts files. Safe to call on a half-made cluster.
remove() {
  local prefix=$1 ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}(n[0-9]+|sw)$"); do
    # Daemons first get TERM (slurmd, munged clean up after themselves), then KILL.
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
    for _ in $(seq 20); do
      [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
      sleep 0.1
    done
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf /etc/netns/"${prefix}"n* 2>/dev/null || true
}

# leftovers PREFIX: one line for each namespace, link, hosts file or process of PREFIX still there.
leftovers() {
  local prefix=$1 p mine
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}(n[0-9]+|sw)$" | sed 's/^/namespace /' || true
  ip -o link show 2>/dev/null | grep -oE "${prefix}(n[0-9]+|sw)\b" | sort -u | sed 's/^/link /' || true
  local h
  for h in /etc/netns/*; do
    [[ ${h#/etc/netns/} =~ ^${prefix}n[0-9]+$ ]] && echo "hosts file $h"
  done
  # A process of a node: in another network namespace than ours (named or
  # not: it outlives `ip netns del`) under a node's host name.
  # (One find for all of /proc: a fork per process would take seconds.)
  mine=$(readlink /proc/self/ns/net)
  for p in $(find /proc -mindepth 3 -maxdepth 3 -path '/proc/[0-9]*/ns/net' -printf '%h %l\n' 2>/dev/null |
             awk -v m="$mine" '$2 != m {sub("^/proc/", "", $1); sub("/ns$", "", $1); print $1}'); do
    nsenter -t "$p" -u hostname 2>/dev/null | grep -qE "^${prefix}n[0-9]+$" &&
      echo "process $p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-80)"
  done
  return 0
}

up() {
  local n=$1 dir=$2 i prefix ns
  [[ $n =~ ^[1-9][0-9]?$ ]] && [ "$n" -le 200 ] || die "up: N must be 1 to 200, got '$n'"
  command -v ip >/dev/null || { echo "cluster.sh: iproute2's ip is not installed" >&2; exit 77; }
  command -v unshare >/dev/null || { echo "cluster.sh: unshare (util-linux) is not installed" >&2; exit 77; }
  prefix=xr${XR_CLUSTER_OWNER:-$PPID}
  ! ip netns list 2>/dev/null | grep -qE "^${prefix}sw" ||
    die "up: process ${prefix#xr} already owns cluster $prefix (one an owner: down it first)"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ ! -f "$dir/cluster.env" ] || die "up: '$dir' already holds a cluster (down it first)"
  # A failure or a signal half way leaves nothing behind.
  trap 'remove '"$prefix"'; rm -f "'"$dir"'/cluster.env"' EXIT
  trap 'exit 1' INT TERM HUP
  ip netns add "${prefix}sw" 2>"$dir/up.err" ||
    { echo "cluster.sh: cannot make network namespaces here: $(cat "$dir/up.err")" >&2; exit 77; }
  ip -n "${prefix}sw" link add br0 type bridge 2>"$dir/up.err" ||
    { echo "cluster.sh: cannot make a bridge here: $(cat "$dir/up.err")" >&2; exit 77; }
  ip -n "${prefix}sw" link set br0 up
  : >"$dir/nodes"
  : >"$dir/hostfile"
  local cpus
  read -r -a cpus <<<"${XR_CLUSTER_CPUS:-}"
  [ ${#cpus[@]} = 0 ] || [ ${#cpus[@]} = "$n" ] ||
    die "up: XR_CLUSTER_CPUS names ${#cpus[@]} CPU lists for $n nodes"
  for i in $(seq 0 $((n - 1))); do
    ns=${prefix}n$i
    echo "$ns $subnet.$((i + 1)) ${cpus[$i]:-}" >>"$dir/nodes"
    echo "$ns slots=$slots" >>"$dir/hostfile"
  done
  for i in $(seq 0 $((n - 1))); do
    ns=${prefix}n$i
    ip netns add "$ns"
    # Made in place: neither end ever exists in the machine's own namespace.
    ip link add "n$i" netns "${prefix}sw" type veth peer name eth0 netns "$ns"
    ip -n "${prefix}sw" link set "n$i" master br0 up
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # The node's names resolve without DNS (a lookup could wait seconds on a resolver).
    mkdir -p "/etc/netns/$ns"
    { echo "127.0.0.1 localhost"; awk '{print $2, $1}' "$dir/nodes"; } >"/etc/netns/$ns/hosts"
  done
  printf '#!/bin/sh\n# Open MPI'"'"'s rsh agent for this cluster: HOST COMMAND...\nexec %q rsh %q "$@"\n' \
    "$self" "$dir" >"$dir/rsh"
  chmod +x "$dir/rsh"
  printf 'PREFIX=%s\nNODES=%s\n' "$prefix" "$n" >"$dir/cluster.env"
  rm -f "$dir/up.err"
  trap - EXIT INT TERM HUP
  echo "$dir"
}

down() {
  local dir=$1
  load "$dir"
  remove "$PREFIX"
  rm -f "$dir/cluster.env"
}

# exec_on DIR NODE CMD...: CMD inside the node's network namespace, with its host name.
exec_on() {
  local dir=$1 ns
  ns=$(node_ns "$dir" "$2")
  shift 2
  [ $# -gt 0 ] || die "exec: no command"
  local cpus
  cpus=$(awk -v n="$ns" '$1 == n {print $3}' "$dir/nodes")
  [ -z "$cpus" ] || set -- taskset -c "$cpus" "$@"
  exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
}

# rsh DIR HOST COMMAND...: what ssh would do, on HOST's node (Open MPI passes
# one command line for the remote shell, so it goes through sh -c).
rsh() {
  local dir=$1 host=$2 name
  shift 2
  name=$(awk -v h="$host" '$1 == h || $2 == h {print $1}' "$dir/nodes")
  [ -n "$name" ] || die "rsh: '$host' is none of the cluster's nodes ($dir/nodes)"
  exec_on "$dir" "$name" sh -c "$*"
}

# mpirun_on DIR ARGS...: mpirun started on node 0. TCP between the nodes
# (only over eth0: lo would connect a rank to itself), shared memory within
# one; the daemons' own traffic over eth0 too.
mpirun_on() {
  local dir
  dir=$(cd "$1" && pwd)  # the agent and hostfile are read from other directories too
  shift
  exec_on "$dir" 0 mpirun --hostfile "$dir/hostfile" --mca plm_rsh_agent "$dir/rsh" \
    --mca btl tcp,vader,self --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 "$@"
}

# sweep: clusters whose owner process is gone (one killed with SIGKILL never ran its trap).
sweep() {
  local prefix
  for prefix in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -oE '^xr[0-9]+sw$' | sed 's/sw$//'); do
    kill -0 "${prefix#xr}" 2>/dev/null && continue
    remove "$prefix"
    echo "removed $prefix (its owner, pid ${prefix#xr}, has ended)"
  done
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case $cmd in
  up) [ $# = 2 ] || usage; up "$1" "$2" ;;
  down) [ $# = 1 ] || usage; down "$1" ;;
  exec) [ $# -ge 3 ] || usage; exec_on "$@" ;;
  rsh) [ $# -ge 3 ] || usage; rsh "$@" ;;
  mpirun) [ $# -ge 1 ] || usage; mpirun_on "$@" ;;
  leftovers) leftovers "${1:-xr[0-9]+}" ;;
  sweep) sweep ;;
  run)
    [ $# -ge 3 ] && [ "$2" = -- ] || usage
    n=$1
    shift 2
    dir=$(mktemp -d "${TMPDIR:-/tmp}/xr-cluster.XXXXXX")
    rc=0
    XR_CLUSTER_OWNER=$$ "$self" up "$n" "$dir" >/dev/null || rc=$?
    [ "$rc" = 0 ] || { rm -rf "$dir"; exit "$rc"; }
    # CMD runs as a job of its own (a process group) in the background, so
    # that a signal here is handled at once (bash runs traps only between
    # foreground commands) and ends CMD's processes outside the nodes too.
    child=
    trap '[ -z "$child" ] || kill -TERM -- -"$child" 2>/dev/null; "$self" down "$dir"; rm -rf "$dir"' EXIT
    trap 'exit 1' INT TERM HUP
    set -m
    XR_CLUSTER=$dir "$@" &
    child=$!
    set +m
    wait "$child" || rc=$?
    child=
    exit "$rc" ;;
  *) usage ;;
esac
