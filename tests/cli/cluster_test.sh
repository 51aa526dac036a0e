#!/usr/bin/env bash
# Several nodes on one machine (tools/cluster.sh: network namespaces on a
# bridge, Open MPI over TCP between them). Each case makes its own 2-node
# cluster and checks at its end that nothing of it is left (namespaces,
# links, hosts files, processes).
#   nodes      ranks 0,1 on node 0 and 2,3 on node 1, each node with its own
#              host name and address and no other interface than lo and eth0
#   dp4        2 nodes x 2 ranks, dp=4, against one rank (parallel_train_check);
#              the gradients crossed the bridge (eth0's counters on both nodes)
#   dp2_tp2    tp inside each node, dp across the nodes, against one rank
#   placement  `xirang train` dp=2 x tp=2 on a 1-CPU and a 2-CPU node: the
#              placement line, each node's line (its ranks, CPUs, polling), no
#              warning; placed round-robin (--map-by node): one warning line
#              naming the split tp groups
#   slurm      a Slurm on the nodes (tools/slurm/on_cluster.sh): `sbatch
#              --nodes=2 tools/slurm/train.sbatch` (srun --mpi=pmix), dp=4:
#              the placement and node lines, the losses of mpirun on the same
#              nodes digit for digit; no daemon left (77: no Slurm or munge)
#   killed     SIGTERM to `cluster.sh run` (with a process left on a node),
#              then SIGKILL to an owner and `cluster.sh sweep`: nothing left
#   no_netns   where namespaces are not allowed (an `ip` that refuses them):
#              `up` exits 77 with the reason and leaves nothing
# Usage: cluster_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
# Exit 77 (ctest: skipped), with the reason, when not root, when ip,
# unshare or mpirun is missing, or when this machine refuses namespaces.
set -uo pipefail
xirang=$1 src=$2 work=$3/$4 case=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

. "$src/tests/cli/lib.sh"
skip() { echo "SKIP [$case]: $*"; exit 77; }
cluster=$src/tools/cluster.sh
check=$(dirname "$xirang")/parallel_train_check

# Clusters of earlier runs killed with SIGKILL (their owners are gone).
"$cluster" sweep

if [ "$case" != no_netns ]; then
  [ "$(id -u)" = 0 ] || skip "network namespaces need root"
  for tool in ip unshare nsenter mpirun; do
    command -v "$tool" >/dev/null || skip "$tool is not installed (iproute2, util-linux, openmpi-bin)"
  done
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# up: a cluster of 2 nodes owned by this script, in ./cluster; its prefix
# in $prefix. Skips where namespaces cannot be made; down on any exit.
prefix=
up() {
  local rc=0
  "$cluster" up 2 cluster >up.txt 2>&1 || rc=$?
  [ "$rc" = 77 ] && skip "$(cat up.txt)"
  [ "$rc" = 0 ] || die "cluster.sh up: $(cat up.txt)"
  prefix=$(sed -n 's/^PREFIX=//p' cluster/cluster.env)
  trap '"$cluster" down cluster 2>/dev/null' EXIT
  trap 'exit 1' INT TERM
}

# down: the cluster removed, and nothing of it left.
down() {
  "$cluster" down cluster || die "cluster.sh down failed"
  trap - EXIT
  nothing_left "$prefix"
}

nothing_left() {
  "$cluster" leftovers "$1" >left.txt
  # Daemons started outside the nodes by mistake name the cluster's files.
  pgrep -af -- "$work/cluster/" | sed 's/^/process outside the nodes /' >>left.txt
  [ ! -s left.txt ] || die "left behind by $1: $(tr '\n' ';' <left.txt)"
}

prepare_data() {
  "$xirang" data prepare --tokenizer bytes --out data --force "$src/tests/assets/text/english.txt" >/dev/null ||
    die "data prepare failed"
}

# rx NODE: bytes node NODE's eth0 has received.
rx() { "$cluster" exec cluster "$1" cat /sys/class/net/eth0/statistics/rx_bytes; }

# equivalence OVERRIDES...: parallel_train_check on 2 nodes x 2 ranks against one rank.
equivalence() {
  [ -x "$check" ] || die "no parallel_train_check beside $xirang"
  prepare_data
  up
  local before0 before1
  before0=$(rx 0) before1=$(rx 1)
  local sets=()
  for o in "$@"; do sets+=(--set "$o"); done
  timeout 150 "$cluster" mpirun cluster -np 4 --bind-to none "$check" --data data "${sets[@]}" >check.txt 2>&1 ||
    die "parallel_train_check: $(grep -E 'FAIL|error|rror:' check.txt | head -n 5) $(tail -n 3 check.txt)"
  grep -q '^[0-9]* passed, 0 failed$' check.txt || die "no passing summary: $(tail -n 3 check.txt)"
  # The gradients of 420K parameters cross between the nodes every step: megabytes, not a handshake's kilobytes.
  local got0=$(($(rx 0) - before0)) got1=$(($(rx 1) - before1))
  [ "$got0" -gt 1000000 ] && [ "$got1" -gt 1000000 ] ||
    die "the nodes' eth0 received $got0 and $got1 bytes: the ranks did not talk over the bridge"
  down
  echo "ok [$case]: $(grep '^ok: per-step losses' check.txt); eth0 received $got0 and $got1 bytes; nothing left"
}

case $case in
  nodes)
    up
    "$cluster" mpirun cluster -np 4 sh -c \
      'echo $OMPI_COMM_WORLD_RANK $(hostname) $(ip -4 -o addr show eth0 | awk "{print \$4}") $(ls /sys/class/net | tr "\n" " ")' \
      >ranks.txt 2>&1 || die "mpirun: $(cat ranks.txt)"
    sort -n ranks.txt >got.txt
    printf '%s\n' "0 ${prefix}n0 10.213.0.1/24 eth0 lo" "1 ${prefix}n0 10.213.0.1/24 eth0 lo" \
      "2 ${prefix}n1 10.213.0.2/24 eth0 lo" "3 ${prefix}n1 10.213.0.2/24 eth0 lo" >want.txt
    diff want.txt got.txt >diff.txt || die "ranks, hosts and addresses: $(tr '\n' ';' <diff.txt)"
    # The addresses exist only inside the nodes.
    ip -4 -o addr | grep -q '10\.213\.' && die "10.213.x appears in this machine's own namespace"
    down
    echo "ok [$case]: $(tr '\n' ';' <got.txt); nothing left" ;;
  dp4) equivalence parallel.dp=4 parallel.bucket_mb=0.1 ;;
  dp2_tp2) equivalence parallel.dp=2 parallel.tp=2 parallel.bucket_mb=0.1 ;;
  placement)
    [ "$(getconf _NPROCESSORS_ONLN)" -ge 2 ] || skip "a 1-CPU and a 2-CPU node need 2 CPUs"
    prepare_data
    XR_CLUSTER_CPUS="0 0-1" up
    args=(train "$src/configs/gpt2_debug.yaml" --set data.train=data/train --set train.steps=2
          --set parallel.dp=2 --set parallel.tp=2)
    timeout 120 "$cluster" mpirun cluster -np 4 --bind-to none "$xirang" "${args[@]}" >slot.txt 2>&1 ||
      die "by slot: $(tail -n 5 slot.txt)"
    timeout 120 "$cluster" mpirun cluster -np 4 --bind-to none --map-by node "$xirang" "${args[@]}" >node.txt 2>&1 ||
      die "by node: $(tail -n 5 node.txt)"
    down
    # By slot: node 0 (1 CPU, 2 threads) sleeps between polls, node 1 (2 CPUs) busy-polls; tp stays inside a node.
    grep -qxF 'ranks: 4 on 2 nodes (2 per node), started by mpirun; more compute threads than CPUs on 1 node (2 ranks, 2 threads, 1 CPU), so communication waits there sleep between polls' slot.txt ||
      die "by slot: placement line: $(grep '^ranks' slot.txt)"
    grep -qxF "node ${prefix}n0: ranks 0,1, 2 compute threads on 1 CPU, communication waits sleep between polls" slot.txt ||
      die "by slot: node 0's line: $(grep '^node' slot.txt)"
    grep -qxF "node ${prefix}n1: ranks 2,3, 2 compute threads on 2 CPUs, communication waits busy-poll" slot.txt ||
      die "by slot: node 1's line: $(grep '^node' slot.txt)"
    [ "$(grep -c '^node ' slot.txt)" = 2 ] || die "by slot: not one line per node: $(grep '^node' slot.txt)"
    grep -q '^warning' slot.txt && die "by slot: a warning: $(grep '^warning' slot.txt)"
    # Round-robin: every tp group {0,1}, {2,3} has a rank on each node.
    [ "$(grep -c '^warning' node.txt)" = 1 ] || die "by node: not one warning line: $(grep '^warning' node.txt)"
    grep -q '^warning: 2 of 2 tensor-parallel groups (tp=2) span nodes' node.txt ||
      die "by node: warning: $(grep '^warning' node.txt)"
    grep -qxF "node ${prefix}n0: ranks 0,2, 2 compute threads on 1 CPU, communication waits sleep between polls" node.txt ||
      die "by node: node 0's line: $(grep '^node' node.txt)"
    grep -qxF "node ${prefix}n1: ranks 1,3, 2 compute threads on 2 CPUs, communication waits busy-poll" node.txt ||
      die "by node: node 1's line: $(grep '^node' node.txt)"
    for f in slot.txt node.txt; do
      grep -q '^trained to step 2 of 2 on 4 ranks' "$f" || die "$f: did not train: $(tail -n 3 "$f")"
    done
    echo "ok [$case]: $(grep '^node' slot.txt | tr '\n' ';') by node: $(grep '^warning' node.txt | cut -c1-60)..." ;;
  slurm)
    prepare_data
    up
    rc=0
    conf=$("$src/tools/slurm/on_cluster.sh" cluster 2>slurm_err.txt) || rc=$?
    cp cluster/slurm/*.log cluster/slurm/*.out . 2>/dev/null
    [ "$rc" = 77 ] && skip "$(cat slurm_err.txt)"
    [ "$rc" = 0 ] || die "on_cluster.sh: $(cat slurm_err.txt)"
    # srun's ranks talk over the nodes' eth0 as mpirun's do.
    export OMPI_MCA_btl=tcp,vader,self OMPI_MCA_btl_tcp_if_include=eth0 XIRANG=$xirang
    args=("$src/configs/gpt2_debug.yaml" --set data.train=data/train --set train.steps=4 --set parallel.dp=4)
    timeout 120 "$cluster" exec cluster 0 env SLURM_CONF="$conf" sbatch --wait --nodes=2 --ntasks-per-node=2 \
      --output=sbatch.out "$src/tools/slurm/train.sbatch" "${args[@]}" --set metrics.jsonl=sbatch.jsonl >sbatch.txt 2>&1 ||
      die "sbatch: $(cat sbatch.txt) $(tail -n 5 sbatch.out 2>/dev/null)"
    timeout 120 "$cluster" mpirun cluster -np 4 --bind-to none "$xirang" train "${args[@]}" \
      --set metrics.jsonl=mpirun.jsonl >mpirun.out 2>&1 || die "mpirun: $(tail -n 5 mpirun.out)"
    down
    grep -qE '^ranks: 4 on 2 nodes \(2 per node\), started by srun in Slurm job [0-9]+$' sbatch.out ||
      die "sbatch: placement line: $(grep '^ranks' sbatch.out)"
    for i in 0 1; do
      grep -qxF "node ${prefix}n$i: ranks $((2 * i)),$((2 * i + 1)), 2 compute threads on 2 CPUs, communication waits busy-poll" sbatch.out ||
        die "sbatch: node $i's line: $(grep '^node' sbatch.out)"
    done
    losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
    [ "$(losses sbatch.jsonl | wc -l)" = 4 ] || die "sbatch.jsonl has $(losses sbatch.jsonl | wc -l) losses, expected 4"
    diff <(losses sbatch.jsonl) <(losses mpirun.jsonl) >diff.txt || die "losses differ from mpirun's: $(tr '\n' ' ' <diff.txt)"
    echo "ok [$case]: sbatch --nodes=2 (srun --mpi=pmix) and mpirun on the cluster: the same 4 losses; nothing left" ;;
  killed)
    # SIGTERM: `run` removes the cluster, the process left on node 1 included.
    "$cluster" run 2 -- sh -c '"$0" exec "$XR_CLUSTER" 1 sleep 300 & sleep 300' "$cluster" >run.txt 2>&1 &
    run=$!
    for _ in $(seq 50); do
      term_prefix=$(ip netns list | awk '{print $1}' | grep -oE "^xr${run}sw$" | sed 's/sw$//')
      [ -n "$term_prefix" ] && [ -n "$("$cluster" leftovers "$term_prefix" | grep '^process')" ] && break
      sleep 0.2
    done
    [ -n "$term_prefix" ] || die "cluster.sh run made no cluster: $(cat run.txt)"
    kill -TERM "$run"
    wait "$run"
    nothing_left "$term_prefix"
    # SIGKILL to the owner: nothing runs its trap; sweep finds the owner gone.
    sleep 300 &
    owner=$!
    XR_CLUSTER_OWNER=$owner "$cluster" up 2 cluster >up.txt 2>&1 || die "up: $(cat up.txt)"
    "$cluster" exec cluster 1 sleep 300 &
    kill -9 "$owner"
    wait "$owner" 2>/dev/null
    "$cluster" sweep >sweep.txt || die "sweep failed"
    grep -q "^removed xr$owner " sweep.txt || die "sweep did not remove xr$owner: $(cat sweep.txt)"
    nothing_left "xr$owner"
    echo "ok [$case]: after SIGTERM and after SIGKILL and sweep, nothing of $term_prefix or xr$owner left" ;;
  no_netns)
    # An ip that refuses namespaces, as an unprivileged container's does.
    mkdir -p fake
    printf '#!/bin/sh\n[ "$1 $2" = "netns add" ] && { echo "mount --make-shared /run/netns failed: Operation not permitted" >&2; exit 1; }\nexec %q "$@"\n' \
      "$(command -v ip)" >fake/ip
    chmod +x fake/ip
    rc=0
    PATH=$PWD/fake:$PATH XR_CLUSTER_OWNER=$$ "$cluster" up 2 cluster >up.txt 2>&1 || rc=$?
    [ "$rc" = 77 ] || die "up exited $rc, expected 77: $(cat up.txt)"
    grep -q '^cluster.sh: cannot make network namespaces here: .*Operation not permitted' up.txt ||
      die "no reason given: $(cat up.txt)"
    [ ! -f cluster/cluster.env ] || die "a refused up left cluster.env"
    nothing_left "xr$$"
    echo "ok [$case]: $(cat up.txt)" ;;
  *) die "unknown case" ;;
esac
