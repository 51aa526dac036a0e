#!/usr/bin/env bash
# Xirang under a real Slurm: a one-node cluster of Debian's daemons (munged
# with a key of its own, slurmctld, slurmd) that the test starts as root with
# a slurm.conf from tools/slurm/single_node_conf.sh, on 127.0.0.1 and free
# ports, its state, spool and logs in a temporary directory.
#   train    2-rank training of configs/gpt2_debug.yaml through
#            `srun --mpi=pmix -n 2`, through tools/slurm/train.sbatch with
#            srun and with mpirun inside the allocation, and under plain
#            mpirun: all four metrics.jsonl have the same losses, digit for
#            digit; rank 0 names the launcher and the node placement
#   no_pmi   `srun --mpi=none -n 2` (tasks that cannot form one MPI job) is
#            one usage error line, not two separate trainings
#   sweep    a 2-point `xirang sweep` through tools/slurm/sweep.sbatch: both
#            points run as srun steps of the allocation and record the same
#            losses as those points under mpirun
# Every daemon and job the test starts is stopped on every exit path.
# Usage: slurm_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
# Exit 77 (ctest: skipped), with the reason, when the Slurm or munge programs
# are missing, when not root, or when the daemons cannot start here.
set -uo pipefail
xirang=$1 src=$2 work=$3/$4 case=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

. "$src/tests/cli/lib.sh"
skip() { echo "SKIP [$case]: $*"; exit 77; }

for tool in munged mungekey slurmctld slurmd srun sbatch sinfo squeue scancel mpirun; do
  command -v "$tool" >/dev/null ||
    skip "$tool is not installed (tools/setup.sh installs munge, slurmctld, slurmd, slurm-client, openmpi-bin)"
done
[ "$(id -u)" = 0 ] || skip "slurmd must run as root to start jobs as other users' processes; run the test as root"

# Daemons' sockets live here: unix socket paths must stay under 108 bytes,
# which a build directory's path may not.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/xirang-slurm.XXXXXX") || die "mktemp failed"
pids=()
export SLURM_CONF=$tmp/slurm.conf
cleanup() {
  local p
  if [ -f "$SLURM_CONF" ] && [ ${#pids[@]} -gt 1 ]; then
    # Jobs first: a job step's slurmstepd outlives a killed slurmd.
    scancel --quiet --full "--user=$(id -un)" 2>/dev/null
    for _ in $(seq 30); do
      [ -z "$(squeue --noheader 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  # The logs stay with the case's work directory, for a failure's diagnosis.
  cp "$tmp"/*.log "$work"/ 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# free_port: a loopback port with nothing listening on it.
free_port() {
  local p
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 40000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
  die "no free loopback port"
}

# started PID NAME LOG...: the daemon is still running a moment after its start, else skip with
# the end of its output and log.
started() {
  local pid=$1 name=$2
  shift 2
  sleep 1
  kill -0 "$pid" 2>/dev/null || skip "$name cannot start here: $(tail -q -n 5 "$@" 2>/dev/null | tr '\n' ' ')"
}

start_slurm() {
  mkdir -m 700 "$tmp/munge" || die "mkdir failed"
  mkdir -m 755 "$tmp/munge-run" || die "mkdir failed"
  mungekey --create --keyfile="$tmp/munge/munge.key" >"$tmp/munged.log" 2>&1 ||
    skip "mungekey cannot create a key: $(cat "$tmp/munged.log")"
  local sock=$tmp/munge-run/munge.socket
  munged --foreground --force --key-file="$tmp/munge/munge.key" --socket="$sock" \
    --pid-file="$tmp/munge-run/munged.pid" --seed-file="$tmp/munge/munged.seed" \
    --log-file="$tmp/munged.log" >>"$tmp/munged.log" 2>&1 &
  pids+=($!)
  started $! munged "$tmp/munged.log"
  munge --socket="$sock" --no-input >/dev/null 2>&1 || skip "munged does not answer: $(tail -n 5 "$tmp/munged.log")"

  # At least 2 CPUs, so that 2 ranks fit on a smaller machine too (oversubscribed).
  local cpus
  cpus=$(getconf _NPROCESSORS_ONLN)
  [ "$cpus" -ge 2 ] || cpus=2
  local ctld_port slurmd_port
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  [ "$slurmd_port" != "$ctld_port" ] || slurmd_port=$(free_port)
  "$src/tools/slurm/single_node_conf.sh" "$tmp" --ctld-port "$ctld_port" --slurmd-port "$slurmd_port" \
    --munge-socket "$sock" --cpus "$cpus" >/dev/null || die "single_node_conf.sh failed"
  slurmctld -D -f "$SLURM_CONF" >"$tmp/slurmctld.out" 2>&1 &
  pids+=($!)
  started $! slurmctld "$tmp/slurmctld.out" "$tmp/slurmctld.log"
  slurmd -D -f "$SLURM_CONF" >"$tmp/slurmd.out" 2>&1 &
  pids+=($!)
  started $! slurmd "$tmp/slurmd.out" "$tmp/slurmd.log"
  local state=
  for _ in $(seq 60); do
    state=$(sinfo --noheader --format=%T 2>/dev/null)
    [ "$state" = idle ] && break
    # A daemon that ends while the node registers could not run here either.
    kill -0 "${pids[1]}" 2>/dev/null || started "${pids[1]}" slurmctld "$tmp/slurmctld.out" "$tmp/slurmctld.log"
    kill -0 "${pids[2]}" 2>/dev/null || started "${pids[2]}" slurmd "$tmp/slurmd.out" "$tmp/slurmd.log"
    sleep 0.5
  done
  [ "$state" = idle ] || die "the node is '$state', not idle, 30 s after slurmd started: $(tail -n 5 "$tmp/slurmd.log")"
  srun --mpi=list 2>&1 | grep -q pmix || die "this Slurm has no pmix MPI plugin: $(srun --mpi=list 2>&1 | tr '\n' ' ')"
}

prepare_data() {
  "$xirang" data prepare --tokenizer bytes --out data --force "$src/tests/assets/text/english.txt" >/dev/null ||
    die "data prepare failed"
}

# losses FILE: one loss per line, as written.
losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }

# same_losses A B STEPS: both files have STEPS losses and they are equal, digit for digit.
same_losses() {
  [ "$(losses "$1" | wc -l)" = "$3" ] || die "$1 has $(losses "$1" | wc -l) losses, expected $3"
  diff <(losses "$1") <(losses "$2") >diff.txt || die "losses differ between $1 and $2: $(tr '\n' ' ' <diff.txt)"
}

cfg=$src/configs/gpt2_debug.yaml
steps=4
train_args=(train "$cfg" --set data.train=data/train --set "train.steps=$steps")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 XIRANG=$xirang

case $case in
  train)
    prepare_data
    start_slurm
    timeout 120 mpirun -np 2 "$xirang" "${train_args[@]}" --set metrics.jsonl=mpirun.jsonl >mpirun.out 2>&1 ||
      die "mpirun: $(tail -n 5 mpirun.out)"
    timeout 120 srun --mpi=pmix -n 2 "$xirang" "${train_args[@]}" --set metrics.jsonl=srun.jsonl >srun.out 2>&1 ||
      die "srun: $(tail -n 5 srun.out)"
    grep -qE '^ranks: 2 on 1 node \(2 per node\), started by srun in Slurm job [0-9]+(; more compute threads than CPUs .*)?$' srun.out ||
      die "no placement line naming srun: $(grep -m 1 '^ranks' srun.out)"
    grep -q '^trained to step 4 of 4 on 2 ranks' srun.out || die "srun: not 2 ranks: $(tail -n 3 srun.out)"
    same_losses srun.jsonl mpirun.jsonl $steps
    for launch in srun mpirun; do
      XIRANG_LAUNCH=$launch timeout 120 sbatch --wait --ntasks=2 --output="sbatch_$launch.out" \
        "$src/tools/slurm/train.sbatch" "$cfg" --set data.train=data/train --set "train.steps=$steps" \
        --set "metrics.jsonl=sbatch_$launch.jsonl" >sbatch.txt 2>&1 ||
        die "sbatch with $launch: $(cat sbatch.txt) $(tail -n 5 "sbatch_$launch.out" 2>/dev/null)"
      grep -qE "^ranks: 2 on 1 node \(2 per node\), started by $launch in Slurm job [0-9]+(; more compute threads than CPUs .*)?$" "sbatch_$launch.out" ||
        die "sbatch with $launch: no placement line: $(grep -m 1 '^ranks' "sbatch_$launch.out")"
      same_losses "sbatch_$launch.jsonl" mpirun.jsonl $steps
    done
    echo "ok [$case]: srun, sbatch (srun), sbatch (mpirun) and mpirun: the same $steps losses, last $(losses mpirun.jsonl | tail -n 1)" ;;
  no_pmi)
    prepare_data
    start_slurm
    timeout 120 srun --mpi=none -n 2 "$xirang" "${train_args[@]}" >out.txt 2>err.txt
    rc=$?
    grep -q '^step ' out.txt err.txt && die "a training ran: $(grep -m 2 '^step ' out.txt err.txt)"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line (from task 0), got: $(cat err.txt)"
    grep -qE '^xirang: usage error: srun started 2 tasks without an MPI process-management interface.*srun --mpi=pmix' err.txt ||
      die "unexpected error line: $(grep '^xirang: ' err.txt)"
    [ "$rc" != 0 ] || die "srun exited 0"
    echo "ok [$case]: $(grep '^xirang: ' err.txt | cut -c1-120)..." ;;
  sweep)
    prepare_data
    cat >sweep.yaml <<SPEC
base: $cfg
set:
  data.train: data/train
points:
  - {ranks: 1}
  - {ranks: 2}
steps: $steps
warmup: 1
timeout_s: 120
env:
  OMP_NUM_THREADS: "1"
SPEC
    # The reference: the same sweep under plain mpirun, before Slurm runs.
    timeout 300 "$xirang" sweep sweep.yaml --out by_mpirun --launcher mpirun >mpirun.out 2>&1 ||
      die "sweep under mpirun: $(tail -n 5 mpirun.out)"
    start_slurm
    timeout 300 sbatch --wait --ntasks=2 --output=sbatch.out "$src/tools/slurm/sweep.sbatch" sweep.yaml \
      --out by_slurm >sbatch.txt 2>&1 || die "sbatch: $(cat sbatch.txt) $(tail -n 5 sbatch.out 2>/dev/null)"
    # Each row: "id":"...", "ranks":N, "status":"..." (one JSON object a line).
    for out in by_mpirun by_slurm; do
      [ "$(grep -c . "$out/results.jsonl")" = 2 ] || die "$out/results.jsonl: $(grep -c . "$out/results.jsonl") rows, expected 2"
      grep -v '"status":"ok"' "$out/results.jsonl" >bad.txt && die "$out: a point is not ok: $(cut -c1-300 bad.txt)"
    done
    sed -E 's/.*"id":"([^"]*)".*"ranks":([0-9]+),.*/\1 \2/' by_slurm/results.jsonl >rows.txt
    n=0
    while read -r id ranks; do
      grep -qE "^ranks: $ranks on 1 node \($ranks per node\), started by srun in Slurm job [0-9]+(; more compute threads than CPUs .*)?$" \
        "by_slurm/points/$id/train.log" ||
        die "point $id: not $ranks ranks started by srun: $(grep -m 1 '^ranks' "by_slurm/points/$id/train.log")"
      same_losses "by_slurm/points/$id/metrics.jsonl" "by_mpirun/points/$id/metrics.jsonl" $steps
      n=$((n + 1))
    done <rows.txt
    [ "$n" = 2 ] || die "$n points compared, expected 2"
    echo "ok [$case]: 2 points as srun steps of one sbatch job, the losses of both equal to mpirun's" ;;
  *) die "unknown case" ;;
esac
