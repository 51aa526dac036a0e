#!/usr/bin/env bash
# Command-line behaviour of the xirang binary: bad input gives exactly one
# error line naming the problem and a non-zero exit; a short training run
# writes the per-step metrics.
# Usage: cli_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

die() { echo "FAIL [$case]: $*"; exit 1; }

# expect_error EXIT_CODE PATTERN -- ARGS...: stderr must be one line matching PATTERN.
expect_error() {
  local want_rc=$1 pattern=$2; shift 3
  "$xirang" "$@" >out.txt 2>err.txt
  local rc=$?
  [ "$rc" = "$want_rc" ] || die "exit code $rc, expected $want_rc for: $* (stderr: $(cat err.txt))"
  [ "$(wc -l <err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
  grep -q '^xirang: ' err.txt || die "error line does not start with 'xirang: ': $(cat err.txt)"
  grep -qE "$pattern" err.txt || die "error line does not match /$pattern/: $(cat err.txt)"
  echo "ok [$case]: $(cat err.txt)"
}

cfg=$src/configs/gpt2_debug.yaml
prepare_data() {
  [ -f data/debug/train/index.json ] && return
  "$xirang" data prepare --tokenizer bytes --out data/debug --force /usr/share/games/fortunes/fortunes \
    /usr/share/games/fortunes/literature >/dev/null || die "data prepare failed"
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
    expect_error 1 "data error: .*data/debug" -- data prepare --tokenizer bytes --out data/debug /usr/share/games/fortunes/fortunes ;;
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
  *) die "unknown case" ;;
esac
