#!/usr/bin/env bash
# Command-line behaviour of the xirang binary: bad input gives exactly one
# error line naming the problem and a non-zero exit; a short training run
# writes the per-step metrics.
# Usage: cli_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"


# expect_run_error EXIT_CODE PATTERN -- ARGS...: a run that got as far as
# printing its memory plan, then failed: exactly one error line, the last.
expect_run_error() {
  local want_rc=$1 pattern=$2; shift 3
  "$xirang" "$@" >out.txt 2>err.txt
  local rc=$?
  [ "$rc" = "$want_rc" ] || die "exit code $rc, expected $want_rc for: $* (stderr: $(cat err.txt))"
  [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
  tail -n 1 err.txt | grep -qE "^xirang: .*$pattern" || die "the last line does not match /$pattern/: $(tail -n 1 err.txt)"
  echo "ok [$case]: $(tail -n 1 err.txt)"
}

cfg=$src/configs/gpt2_debug.yaml
prepare_data() {
  [ -f data/debug/train/index.json ] && return
  "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
    >/dev/null || die "data prepare failed"
}

case $case in
  no_args)
    "$xirang" >out.txt 2>err.txt; rc=$?
    [ "$rc" = 2 ] || die "exit code $rc, expected 2"
    grep -q '^usage: xirang' err.txt || die "no usage text: $(cat err.txt)"
    echo "ok [$case]" ;;
  unknown_command) expect_error 2 "unknown command 'frobnicate'" -- frobnicate ;;
  missing_config) expect_error 1 "config error: .*no_such.yaml" -- train no_such.yaml ;;
  unknown_key) prepare_data; expect_error 1 "config error: .*train\.microbatch" -- train "$cfg" --set train.microbatch=2 ;;
  wrong_type) prepare_data; expect_error 1 "config error: .*model\.n_head.*abc" -- train "$cfg" --set model.n_head=abc ;;
  heads_not_dividing) prepare_data; expect_error 1 "config error: .*model\.d_model.*model\.n_head" -- train "$cfg" --set model.n_head=5 ;;
  missing_data) expect_error 1 "config error: .*data\.train.*does_not_exist" -- train "$cfg" --set data.train=does_not_exist/train ;;
  nccl_alone_cpu) prepare_data; expect_error 1 "config error: .*comm\.nccl_alone.*device\.backend=cpu" -- train "$cfg" --set comm.nccl_alone=true ;;
  bad_batch) prepare_data; expect_error 1 "config error: .*train\.global_batch" -- train "$cfg" --set train.global_batch=7 --set train.micro_batch=2 ;;
  unknown_key_in_file)
    prepare_data
    sed 's/^  lr:/  learning_rate:/' "$cfg" >bad.yaml
    expect_error 1 "config error: .*bad\.yaml.*train\.learning_rate" -- train bad.yaml ;;
  syntax_error)
    printf 'model:\n  n_layer: [1, 2\n' >syntax.yaml
    expect_error 1 "config error: .*syntax\.yaml" -- train syntax.yaml ;;
  missing_input) expect_error 1 "data error: .*no_such_file\.txt" -- data prepare --tokenizer bytes --out d2 no_such_file.txt ;;
  overwrite_refused)
    prepare_data
    expect_error 1 "data error: .*data/debug" -- data prepare --tokenizer bytes --out data/debug "$src/tests/assets/text/english.txt" ;;
  corrupt_shard)
    prepare_data
    rm -rf corrupt && cp -r data/debug corrupt
    truncate -s 1000 corrupt/train/shard_00000.bin
    expect_error 1 "data error: .*shard_00000\.bin.*truncated" -- train "$cfg" --set data.train=corrupt/train ;;
  train_writes_metrics)
    prepare_data
    rm -f metrics.jsonl
    "$xirang" train "$cfg" --set train.steps=3 --set data.train=data/debug/train --set data.val=data/debug/val \
      --set train.eval_every=3 --set metrics.jsonl=metrics.jsonl >out.txt 2>err.txt || die "train failed: $(cat err.txt)"
    [ "$(wc -l <metrics.jsonl)" = 3 ] || die "expected 3 metrics lines, got $(wc -l <metrics.jsonl)"
    for key in step loss lr grad_norm tokens_per_s step_ms mfu peak_source data_wait_ms; do
      grep -q "\"$key\":" metrics.jsonl || die "metrics.jsonl lacks $key"
    done
    tail -n 1 metrics.jsonl | grep -q '"val_loss":' || die "the eval step has no val_loss"
    grep -q 'validation loss .* unigram' out.txt || die "no validation summary: $(cat out.txt)"
    grep -q 'memory plan' err.txt || die "no memory plan printed"
    echo "ok [$case]" ;;
  resume_bitwise)
    # 20 steps straight against 10, stop, resume, 10 more: identical losses.
    prepare_data
    rm -rf ck straight.jsonl resumed.jsonl
    common=(--set data.train=data/debug/train --set train.steps=20)
    "$xirang" train "$cfg" "${common[@]}" --set metrics.jsonl=straight.jsonl >/dev/null 2>&1 || die "straight run failed"
    "$xirang" train "$cfg" "${common[@]}" --set train.stop_after=10 --set checkpoint.dir=ck >/dev/null 2>&1 || die "first half failed"
    "$xirang" train "$cfg" "${common[@]}" --set checkpoint.dir=ck --set metrics.jsonl=resumed.jsonl >out.txt 2>err.txt ||
      die "resume failed: $(cat err.txt)"
    grep -q "resumed from .*step_00000010 at step 10" err.txt || die "did not resume at step 10: $(cat err.txt)"
    tail -n 10 straight.jsonl | sed 's/.*"loss":\([^,]*\),.*/\1/' >a.txt
    sed 's/.*"loss":\([^,]*\),.*/\1/' resumed.jsonl >b.txt
    [ "$(wc -l <b.txt)" = 10 ] || die "the resumed run logged $(wc -l <b.txt) steps, expected 10"
    cmp -s a.txt b.txt || die "resumed losses differ from the uninterrupted run: $(paste a.txt b.txt | head -3)"
    echo "ok [$case]: steps 11-20 bitwise equal" ;;
  kill_in_save)
    # A kill -9 halfway through writing the step-4 checkpoint leaves step 2 loadable and resumable.
    prepare_data
    rm -rf ck2
    common=(--set data.train=data/debug/train --set train.steps=6 --set checkpoint.dir=ck2 --set checkpoint.every=2)
    "$xirang" train "$cfg" "${common[@]}" --set faults.kind=kill_in_save --set faults.step=4 >out.txt 2>err.txt
    rc=$?
    [ $rc = 137 ] || die "expected the run to be killed (137), got $rc: $(tail -2 err.txt)"
    [ "$(cat ck2/latest)" = step_00000002 ] || die "latest is '$(cat ck2/latest)', expected step_00000002"
    "$xirang" ckpt inspect ck2 >insp.txt 2>&1 || die "the previous checkpoint does not verify: $(tail -3 insp.txt)"
    "$xirang" train "$cfg" "${common[@]}" >out.txt 2>err.txt || die "resume after the kill failed: $(cat err.txt)"
    grep -q "resumed from .*step_00000002 at step 2" err.txt || die "did not resume from step 2: $(cat err.txt)"
    [ "$(cat ck2/latest)" = step_00000006 ] || die "latest after the resumed run is '$(cat ck2/latest)'"
    echo "ok [$case]" ;;
  kill_in_save_empty_rank)
    # Under dp=2, rank 1 writes no tensors (the parameters and the optimizer state are rank 0's):
    # killed in its save, it still dies before its file is complete.
    command -v mpirun >/dev/null || { echo "SKIP [$case]: mpirun is not installed"; exit 77; }
    prepare_data
    rm -rf ck5
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 mpirun -np 2 --oversubscribe \
      "$xirang" train "$cfg" --set data.train=data/debug/train --set train.steps=6 --set checkpoint.dir=ck5 \
      --set checkpoint.every=2 --set parallel.dp=2 --set faults.kind=kill_in_save --set faults.rank=1 \
      --set faults.step=4 >out.txt 2>err.txt
    rc=$?
    [ $rc = 137 ] || die "expected the run to be killed (137), got $rc: $(tail -2 err.txt)"
    grep -q "rank 1: injecting fault 'kill_in_save' at step 4" err.txt || die "rank 1 did not die in its save: $(cat err.txt)"
    [ "$(cat ck5/latest)" = step_00000002 ] || die "latest is '$(cat ck5/latest)', expected step_00000002"
    "$xirang" ckpt inspect ck5 >insp.txt 2>&1 || die "the previous checkpoint does not verify: $(tail -3 insp.txt)"
    echo "ok [$case]" ;;
  placement)
    # The placement line: two one-thread ranks with a CPU each say no more;
    # confined to one CPU (taskset) they share it, and the line names the
    # crowded node and says that communication waits sleep between polls
    # (comm.busy_poll=auto turns busy polling off there: the line says what
    # the channels do, not what the config asked); with comm.busy_poll=on
    # it names the node only, with off it says the same as auto.
    command -v mpirun >/dev/null && command -v taskset >/dev/null ||
      { echo "SKIP [$case]: mpirun or taskset is not installed"; exit 77; }
    prepare_data
    # run2 [PREFIX...] -- [MPIRUN OPTIONS...] -- [TRAIN OPTIONS...]
    run2() {
      local pre=() opts=()
      while [ "$1" != -- ]; do pre+=("$1"); shift; done
      shift
      while [ "$1" != -- ]; do opts+=("$1"); shift; done
      shift
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 "${pre[@]}" mpirun -np 2 --oversubscribe \
        "${opts[@]}" "$xirang" train "$cfg" --set data.train=data/debug/train --set train.steps=1 --set parallel.dp=2 "$@" \
        >out.txt 2>err.txt || die "the dp=2 run failed: $(tail -n 3 err.txt)"
    }
    # nproc counts OMP_NUM_THREADS (set for the tests) as a limit: ask it without.
    if [ "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" -ge 2 ]; then
      run2 -- --
      grep -qx 'ranks: 2 on 1 node (2 per node), started by mpirun' out.txt ||
        die "two ranks on $(env -u OMP_NUM_THREADS nproc) CPUs: $(grep -m 1 '^ranks' out.txt)"
    else
      echo "(one CPU: the uncrowded run is left out)"
    fi
    # mpirun would bind the ranks to CPUs of its own choosing: unbound, they keep taskset's.
    run2 taskset -c 0 -- --bind-to none --
    grep -qx "ranks: 2 on 1 node (2 per node), started by mpirun; more compute threads than CPUs on 1 node (2 ranks, 2 threads, 1 CPU), so communication waits there sleep between polls" out.txt ||
      die "two ranks on one CPU: $(grep -m 1 '^ranks' out.txt)"
    echo "ok [$case]: $(grep -m 1 '^ranks' out.txt)"
    run2 taskset -c 0 -- --bind-to none -- --set comm.busy_poll=on
    grep -qx "ranks: 2 on 1 node (2 per node), started by mpirun; more compute threads than CPUs on 1 node (2 ranks, 2 threads, 1 CPU)" out.txt ||
      die "two ranks on one CPU, comm.busy_poll=on: $(grep -m 1 '^ranks' out.txt)"
    echo "ok [$case]: $(grep -m 1 '^ranks' out.txt)"
    run2 taskset -c 0 -- --bind-to none -- --set comm.busy_poll=off
    grep -qx "ranks: 2 on 1 node (2 per node), started by mpirun; more compute threads than CPUs on 1 node (2 ranks, 2 threads, 1 CPU), so communication waits there sleep between polls" out.txt ||
      die "two ranks on one CPU, comm.busy_poll=off: $(grep -m 1 '^ranks' out.txt)"
    echo "ok [$case]: $(grep -m 1 '^ranks' out.txt)" ;;
  corrupt_checkpoint)
    prepare_data
    rm -rf ck3
    "$xirang" train "$cfg" --set data.train=data/debug/train --set train.steps=2 --set checkpoint.dir=ck3 >/dev/null 2>&1 ||
      die "training failed"
    f=ck3/step_00000002/rank_00000.h5
    size=$(stat -c %s "$f")
    # Overwrite 8 bytes three quarters into the file: tensor data (the optimizer state).
    printf 'XXXXXXXX' | dd of="$f" bs=1 seek=$((size * 3 / 4)) conv=notrunc status=none
    "$xirang" ckpt inspect ck3 >insp.txt 2>&1 && die "inspect did not notice the damage"
    grep -q "DAMAGED: .*corrupted" insp.txt || die "inspect did not name the damage: $(tail -3 insp.txt)"
    expect_run_error 1 "checkpoint error: .*corrupted" -- train "$cfg" --set data.train=data/debug/train \
      --set train.steps=4 --set checkpoint.dir=ck3 ;;
  checkpoint_other_model)
    prepare_data
    rm -rf ck4
    "$xirang" train "$cfg" --set data.train=data/debug/train --set train.steps=1 --set checkpoint.dir=ck4 >/dev/null 2>&1 ||
      die "training failed"
    expect_run_error 1 "checkpoint error: .*shape .*different model" -- train "$cfg" --set data.train=data/debug/train \
      --set train.steps=4 --set checkpoint.dir=ck4 --set model.d_model=128 ;;
  *) die "unknown case" ;;
esac
