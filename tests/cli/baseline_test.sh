#!/usr/bin/env bash
# metrics.baseline (runtime/observe/baseline.h): a run made slower on purpose
# (faults.kind=slow_rank on its one rank, about 4x a debug step) against the
# metrics.jsonl of a normal run of the same config is flagged (the warning
# line, below_baseline in its metrics.jsonl, the closing comparison); a
# normal run is not flagged against a baseline it matches or beats; a missing
# or malformed baseline is one error line.
# The tolerance is 0.5, not the default 0.1. Both verdicts hold under any load
# the other tests put on the machine: two runs made one after the other do
# not see the same load (under ctest -j a normal run measured 4.2x slower than
# the baseline made right before it), so the normal run's baseline is itself
# slowed by 60 ms a step (about 6x an idle debug step): the normal run is
# flagged only if load makes it more than 2(1 + 60/t) times slower than the
# baseline run was, t the idle step time, which is over 10x. The slowed run
# (200 ms a step) is about 17x an idle step, so it stays flagged unless the
# baseline run alone was that much slower.
# Usage: baseline_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1
. "$src/tests/cli/lib.sh"

cfg=$src/configs/gpt2_debug.yaml
common=(--set data.train=data/debug/train --set train.steps=12)
# The data (made by the first case that needs it) and a baseline run, made
# right before the run compared with it, so that both see the same load.
# prepare_baseline [overrides...]: the overrides go to the baseline run.
prepare_baseline() {
  [ -f data/debug/train/index.json ] ||
    "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
      >/dev/null || die "data prepare failed"
  "$xirang" train "$cfg" "${common[@]}" --set metrics.jsonl=base.jsonl "$@" >/dev/null 2>&1 ||
    die "the baseline run failed"
  # The monitors' fields are written only when they are on.
  ! grep -qE '"(below_baseline|slowest_rank|straggler_ratio)":' base.jsonl || die "a run without monitors logs their fields"
}
# against_baseline JSONL overrides...: a run against base.jsonl.
against_baseline() {
  local jsonl=$1; shift
  "$xirang" train "$cfg" "${common[@]}" --set metrics.jsonl="$jsonl" --set metrics.baseline=base.jsonl \
    --set metrics.baseline_tolerance=0.5 "$@" >out.txt 2>err.txt || die "train failed: $(tail -n 3 err.txt)"
  grep -q '^baseline comparison' err.txt || die "no closing comparison"
  grep -qE '^  tokens_per_s +[0-9.]+ +[0-9.]+ ' err.txt || die "the comparison lacks tokens_per_s"
  grep -q '"below_baseline":' "$jsonl" || die "$jsonl lacks below_baseline"
}

case $case in
  slow_run_flagged)
    prepare_baseline
    against_baseline slow.jsonl --set faults.kind=slow_rank --set faults.rank=0 --set faults.step=1 \
      --set faults.delay_ms=200
    grep '^baseline' err.txt
    [ "$(grep -c '^baseline: tokens/s .* below the baseline' err.txt)" = 1 ] || die "expected one warning line"
    # Its first step is left out, so steps 2-6 make the 5 in a row (metrics.baseline_steps).
    grep -q '"step":6,.*"below_baseline":true' slow.jsonl || die "step 6 is not below the baseline"
    grep -q '"step":5,.*"below_baseline":false' slow.jsonl || die "step 5 is already below the baseline"
    grep -q '"step":12,.*"below_baseline":true' slow.jsonl || die "the last step is not below the baseline"
    ! grep -q 'back within' err.txt || die "the slow run came back within the baseline's band"
    echo "ok [$case]" ;;
  normal_run_not_flagged)
    prepare_baseline --set faults.kind=slow_rank --set faults.rank=0 --set faults.step=1 --set faults.delay_ms=60
    against_baseline normal.jsonl
    ! grep -q '^baseline: tokens/s' err.txt || die "a normal run was flagged: $(grep '^baseline:' err.txt)"
    ! grep -q '"below_baseline":true' normal.jsonl || die "a step of the normal run is below the baseline"
    echo "ok [$case]: $(grep -E '^  tokens_per_s' err.txt)" ;;
  missing_baseline)
    prepare_baseline
    "$xirang" train "$cfg" "${common[@]}" --set metrics.baseline=missing.jsonl >out.txt 2>err.txt && die "train succeeded"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
    tail -n 1 err.txt | grep -q "^xirang: config error: metrics.baseline: cannot open 'missing.jsonl'" ||
      die "unexpected error line: $(tail -n 1 err.txt)"
    grep -q '^step ' err.txt && die "training started before the error"
    echo "ok [$case]: $(tail -n 1 err.txt)" ;;
  malformed_baseline)
    prepare_baseline
    head -n 1 base.jsonl >short.jsonl
    echo 'not json' >bad.jsonl
    for f in short.jsonl bad.jsonl; do
      "$xirang" train "$cfg" "${common[@]}" --set metrics.baseline=$f >out.txt 2>err.txt && die "train succeeded with $f"
      [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
      tail -n 1 err.txt | grep -q "^xirang: data error: metrics.baseline '$f'" || die "unexpected error line: $(tail -n 1 err.txt)"
      echo "ok [$case]: $(tail -n 1 err.txt)"
    done ;;
  *) die "unknown case" ;;
esac
