#!/usr/bin/env bash
# Preemption (runtime/preemption.h): SIGTERM or SIGUSR1 to one rank, to
# mpirun or to a single process stops the run after the current step with a
# committed checkpoint of that step, one "preempted:" line and exit status
# 75; a run resumed from it (checkpoint.resume=auto) logs the same losses as
# an uninterrupted run, bit for bit; a second signal ends the process at once.
# Usage: preempt_test.sh XIRANG SOURCE_DIR WORK_DIR CASE   (77: mpirun is missing)
#
# The interrupted runs are slowed by faults.kind=slow_rank (a sleep in each
# step: no effect on the numbers), and the signal is sent only once the run
# has logged a step, so a loaded machine changes only where the run stops.
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1
. "$src/tests/cli/lib.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

cfg=$src/configs/gpt2_debug.yaml
steps=40
common=(--set data.train=data/debug/train --set train.steps=$steps)
slow=(--set faults.kind=slow_rank --set faults.rank=0 --set faults.step=1)

prepare_data() {
  [ -f data/debug/train/index.json ] && return
  "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
    >/dev/null || die "data prepare failed"
}
need_mpirun() { command -v mpirun >/dev/null || { echo "SKIP [$case]: mpirun is missing"; exit 77; }; }

# wait_for_steps FILE N PID: until FILE (metrics.jsonl) has N lines; fails if PID ends first.
wait_for_steps() {
  local i
  for i in $(seq 1200); do
    [ -f "$1" ] && [ "$(wc -l <"$1")" -ge "$2" ] && return 0
    kill -0 "$3" 2>/dev/null || die "the run ended before logging $2 steps: $(tail -3 err.txt)"
    sleep 0.1
  done
  die "no $2 steps logged in 120 s"
}

# rank_pid MPIRUN_PID RANK [THREAD]: the pid of that world rank among mpirun's
# children, once it has a thread named THREAD (when given). Looked up again
# every 0.1 s for up to 30 s: under a loaded machine one look can find no rank
# (seen in the full suite); fails if mpirun ends first.
rank_pid() {
  local i p
  for i in $(seq 300); do
    for p in $(pgrep -P "$1"); do
      tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" || continue
      [ -z "${3:-}" ] || grep -qx "$3" /proc/"$p"/task/*/comm 2>/dev/null || continue
      echo "$p"; return 0
    done
    kill -0 "$1" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# check_routed PID: in that rank only the thread "xirang-signals" takes SIGTERM
# and SIGUSR1 (runtime/preemption.h route_stop_signals): every other thread
# blocks both (bits 9 and 14 of SigBlk, 0x4200).
check_routed() {
  local t blk open=""
  for t in /proc/"$1"/task/*; do
    blk=$(sed -n 's/^SigBlk:[[:space:]]*//p' "$t/status" 2>/dev/null) || continue
    [ -n "$blk" ] || continue
    (( (16#$blk & 16#4200) == 16#4200 )) || open="$open $(cat "$t/comm" 2>/dev/null)"
  done
  [ "$open" = " xirang-signals" ] || die "pid $1: the threads that take the stop signals are:${open:- none}"
}

# The uninterrupted dp2 run the resumed ones are compared with (made once).
straight_dp2() {
  # Shared by the cases of one ctest run; made again when the binary is newer (a rebuilt kernel may round differently).
  [ -f straight_dp2.jsonl ] && [ "$(wc -l <straight_dp2.jsonl)" = $steps ] && [ straight_dp2.jsonl -nt "$xirang" ] && return
  rm -f straight_dp2.jsonl
  mpirun -np 2 "$xirang" train "$cfg" "${common[@]}" --set metrics.jsonl=straight_dp2.jsonl >/dev/null 2>straight.err ||
    die "the uninterrupted dp2 run failed: $(tail -3 straight.err)"
}

# check_stopped CKPT_DIR METRICS SIGNAL RANK: the line names the signal, the
# rank and the last logged step ($step), whose checkpoint is latest and verifies.
check_stopped() {
  local ck=$1 metrics=$2 sig=$3 rank=$4
  step=$(wc -l <"$metrics")
  grep -q "^preempted: $sig received by rank $rank; stopped after step $step of $steps; saved $ck/step_0*$step .*exit status 75" err.txt ||
    die "no preempted line for $sig on rank $rank at step $step: $(grep -v '^step ' err.txt | tail -5)"
  [ "$(cat "$ck/latest")" = "$(printf 'step_%08d' "$step")" ] || die "latest is '$(cat "$ck/latest")', expected step $step"
  "$xirang" ckpt inspect "$ck" >insp.txt 2>&1 || die "the checkpoint does not verify: $(tail -3 insp.txt)"
}

# check_resume CKPT_DIR STEP: a dp2 run resumes at STEP and logs the uninterrupted run's losses.
check_resume() {
  local ck=$1 step=$2
  straight_dp2
  rm -f resumed.jsonl
  mpirun -np 2 "$xirang" train "$cfg" "${common[@]}" --set checkpoint.dir="$ck" --set checkpoint.resume=auto \
    --set metrics.jsonl=resumed.jsonl >out.txt 2>err2.txt || die "the resumed run failed: $(tail -3 err2.txt)"
  grep -q "resumed from .*step_0*$step at step $step" err2.txt || die "did not resume at step $step: $(grep resumed err2.txt)"
  tail -n $((steps - step)) straight_dp2.jsonl | sed 's/.*"loss":\([^,]*\),.*/\1/' >a.txt
  sed 's/.*"loss":\([^,]*\),.*/\1/' resumed.jsonl >b.txt
  [ "$(wc -l <b.txt)" = $((steps - step)) ] || die "the resumed run logged $(wc -l <b.txt) steps, expected $((steps - step))"
  cmp -s a.txt b.txt || die "resumed losses differ from the uninterrupted run: $(paste a.txt b.txt | head -3)"
}

prepare_data
case $case in
  one_rank)
    # SIGTERM to a single process that saves every step (asynchronously: the stop waits for the
    # step's own save); then SIGUSR1 without checkpoint.dir: nothing saved, the line says so.
    rm -rf ck1 m1.jsonl
    "$xirang" train "$cfg" "${common[@]}" "${slow[@]}" --set faults.delay_ms=300 --set checkpoint.dir=ck1 \
      --set checkpoint.every=1 --set metrics.jsonl=m1.jsonl >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m1.jsonl 2 $pid
    kill -TERM $pid
    wait $pid; rc=$?
    [ $rc = 75 ] || die "exit status $rc, expected 75: $(tail -3 err.txt)"
    check_stopped ck1 m1.jsonl SIGTERM 0
    rm -f m1b.jsonl
    "$xirang" train "$cfg" "${common[@]}" "${slow[@]}" --set faults.delay_ms=300 --set metrics.jsonl=m1b.jsonl \
      >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m1b.jsonl 2 $pid
    kill -USR1 $pid
    wait $pid; rc=$?
    [ $rc = 75 ] || die "SIGUSR1: exit status $rc, expected 75: $(tail -3 err.txt)"
    grep -q "^preempted: SIGUSR1 received by rank 0; .*checkpoint.dir is not set, so nothing was saved; exit status 75" err.txt ||
      die "no 'nothing was saved' line: $(tail -3 err.txt)"
    echo "ok [$case]: SIGTERM stopped after step $step with a checkpoint; SIGUSR1 without checkpoint.dir said so" ;;
  second_signal)
    # A step of 5 s: the second SIGTERM must end the process long before the step does.
    rm -rf m2.jsonl ck2
    "$xirang" train "$cfg" "${common[@]}" --set faults.kind=slow_rank --set faults.rank=0 --set faults.step=2 \
      --set faults.delay_ms=5000 --set checkpoint.dir=ck2 --set metrics.jsonl=m2.jsonl >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m2.jsonl 1 $pid
    sleep 0.5
    start=$(date +%s%N)
    kill -TERM $pid; sleep 0.2; kill -TERM $pid
    wait $pid; rc=$?
    took_ms=$(( ($(date +%s%N) - start) / 1000000 ))
    [ $rc = 143 ] || die "exit status $rc, expected 143 (killed by the second SIGTERM): $(tail -3 err.txt)"
    [ "$(ls ck2 2>/dev/null | grep -c '^step_')" = 0 ] || die "a checkpoint was saved: $(ls ck2)"
    [ $took_ms -lt 3000 ] || die "the second signal took ${took_ms} ms to end the process"
    echo "ok [$case]: the second SIGTERM ended the process in ${took_ms} ms (status 143)" ;;
  rank_dp2)
    # SIGTERM to rank 1 of a dp2 job: every rank stops after the same step; mpirun returns 75.
    need_mpirun
    rm -rf ck3 m3.jsonl
    mpirun -np 2 "$xirang" train "$cfg" "${common[@]}" "${slow[@]}" --set faults.delay_ms=300 --set checkpoint.dir=ck3 \
      --set metrics.jsonl=m3.jsonl >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m3.jsonl 2 $pid
    r1=$(rank_pid $pid 1) || die "rank 1's process not found among mpirun's children"
    kill -TERM "$r1"
    wait $pid; rc=$?
    [ $rc = 75 ] || die "mpirun's exit status $rc, expected 75: $(tail -n 20 err.txt)"
    check_stopped ck3 m3.jsonl SIGTERM 1
    check_resume ck3 "$step"
    echo "ok [$case]: stopped after step $step, status 75, resumed steps $((step + 1))-$steps bitwise equal" ;;
  mpirun_usr1)
    # SIGUSR1 to mpirun (what a batch script's trap forwards): Open MPI passes it on at once.
    need_mpirun
    rm -rf ck4 m4.jsonl
    mpirun -np 2 "$xirang" train "$cfg" "${common[@]}" "${slow[@]}" --set faults.delay_ms=300 --set checkpoint.dir=ck4 \
      --set metrics.jsonl=m4.jsonl >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m4.jsonl 2 $pid
    for r in 0 1; do
      rp=$(rank_pid $pid $r xirang-signals) || die "rank $r with its xirang-signals thread not found among mpirun's children (looked for 30 s, or until mpirun ended)"
      check_routed "$rp"
    done
    kill -USR1 $pid
    wait $pid; rc=$?
    [ $rc = 75 ] || die "mpirun's exit status $rc, expected 75: $(tail -n 20 err.txt)"
    check_stopped ck4 m4.jsonl SIGUSR1 1
    check_resume ck4 "$step"
    echo "ok [$case]: stopped after step $step, status 75, resumed bitwise" ;;
  mpirun_term)
    # SIGTERM to mpirun: Open MPI 4.1 forwards it after odls_base_sigkill_timeout seconds and
    # SIGKILLs the ranks one timeout later; mpirun itself then exits 1 whatever the ranks return.
    need_mpirun
    rm -rf ck5 m5.jsonl
    mpirun --mca odls_base_sigkill_timeout 5 -np 2 "$xirang" train "$cfg" "${common[@]}" "${slow[@]}" \
      --set faults.delay_ms=300 --set checkpoint.dir=ck5 --set metrics.jsonl=m5.jsonl >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m5.jsonl 2 $pid
    kill -TERM $pid
    wait $pid; rc=$?
    [ $rc != 0 ] || die "mpirun exited 0 after SIGTERM"
    check_stopped ck5 m5.jsonl SIGTERM 1
    [ "$step" -lt $steps ] || die "the run finished before the signal arrived"
    check_resume ck5 "$step"
    echo "ok [$case]: stopped after step $step (mpirun status $rc), resumed bitwise" ;;
  sbatch_script)
    # tools/slurm/train.sbatch run as a plain script (what Slurm's --signal=B:USR1 signals):
    # it passes SIGUSR1 on to mpirun and returns the ranks' 75.
    need_mpirun
    rm -rf ck6 m6.jsonl
    (cd "$work" && XIRANG="$xirang" XIRANG_LAUNCH=mpirun OMP_NUM_THREADS=1 "$src/tools/slurm/train.sbatch" "$cfg" \
      "${common[@]}" "${slow[@]}" --set faults.delay_ms=300 --set checkpoint.dir=ck6 --set metrics.jsonl=m6.jsonl) \
      >out.txt 2>err.txt &
    pid=$!
    wait_for_steps m6.jsonl 2 $pid
    script=$(pgrep -f "train.sbatch $cfg" | head -1)
    [ -n "$script" ] || die "the batch script's process not found"
    kill -USR1 "$script"
    wait $pid; rc=$?
    [ $rc = 75 ] || die "the batch script's exit status $rc, expected 75: $(tail -5 err.txt; tail -3 out.txt)"
    grep -q "train.sbatch: SIGUSR1: asking the ranks to save" out.txt || die "the script did not report the signal: $(cat out.txt)"
    check_stopped ck6 m6.jsonl SIGUSR1 1
    echo "ok [$case]: the batch script passed SIGUSR1 on; stopped after step $step with status 75" ;;
  *) die "unknown case '$case'" ;;
esac
