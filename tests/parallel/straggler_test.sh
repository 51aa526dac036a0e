#!/usr/bin/env bash
# Straggler detection (runtime/observe/straggler.h): with faults.kind=slow_rank one
# rank computes faults.delay_ms longer every step (about 4x a debug step's
# compute here); the detector must name that rank, by world rank and grid
# coordinates, on every check and warn once its run of checks reaches
# metrics.straggler_checks. The same layout unperturbed must name none at
# the default ratio 1.3. Each check takes the median of 6 steps' compute
# times: on 2 cores running 4 ranks a single step's compute varies up to
# 2x, its median over 6 steps by up to about 1.4x between ranks, and
# rarely on the same rank twice in a row (observed).
# Usage: straggler_test.sh MPIEXEC XIRANG SOURCE_DIR DATA_DIR CASE
#   CASE: dp4_slow | pp2_slow | dp4_clean | pp2_clean
set -uo pipefail
mpiexec=$1 xirang=$2 src=$3 data=$4 case=$5
die() { echo "FAIL [$case]: $*"; exit 1; }
every=6 checks=3 steps=24
case $case in
  dp4_*) np=4 layout=(--set parallel.dp=4) slow=2 where='dp 2, tp 0, pp 0' ;;
  pp2_*) np=2 layout=(--set parallel.pp=2) slow=1 where='dp 0, tp 0, pp 1' ;;
  *) die "unknown case" ;;
esac
fault=()
[[ $case == *_slow ]] && fault=(--set faults.kind=slow_rank --set faults.rank=$slow --set faults.step=1
                                --set faults.delay_ms=150)
jsonl=$case.jsonl
rm -f "$jsonl"
timeout 120 "$mpiexec" -np $np --oversubscribe "$xirang" train "$src/configs/gpt2_debug.yaml" "${layout[@]}" \
  --set train.steps=$steps --set data.train="$data/train" --set metrics.jsonl="$jsonl" \
  --set metrics.straggler_every=$every --set metrics.straggler_checks=$checks "${fault[@]}" >out.txt 2>err.txt ||
  die "training failed: $(tail -n 5 err.txt)"
grep '^straggler:' err.txt
# step, slowest_rank and straggler_ratio of every logged step, one line each.
sed 's/.*"step":\([0-9]*\),.*"slowest_rank":\(-\{0,1\}[0-9]*\),"straggler_ratio":\([0-9.e+-]*\).*/\1 \2 \3/' \
  "$jsonl" >checks.txt
[ "$(wc -l <checks.txt)" = $steps ] || die "expected $steps metrics lines"
grep -qv '^[0-9]* -\{0,1\}[0-9]* [0-9.e+-]*$' checks.txt && die "metrics.jsonl lacks slowest_rank or straggler_ratio"
awk -v e=$every '$1 < e && ($2 != -1 || $3 != 0) { exit 1 }' checks.txt ||
  die "a step before the first check has a straggler: $(head -n $every checks.txt | tr '\n' ';')"
if [[ $case == *_clean ]]; then
  ! grep -q '^straggler:' err.txt || die "a straggler was named in an unperturbed run"
  echo "ok [$case]: no straggler; ratios at the checks: $(awk -v e=$every '$1 % e == 0 { print $3 }' checks.txt | tr '\n' ' ')"
  exit 0
fi
# Every check names the slow rank, and the warning comes once, at the check that completes the run.
awk -v e=$every -v r=$slow '$1 % e == 0 && ($2 != r || $3 <= 1.3) { exit 1 }' checks.txt ||
  die "a check did not name rank $slow: $(awk -v e=$every '$1 % e == 0' checks.txt | tr '\n' ';')"
pattern="^straggler: rank $slow \\($where\\) compute [0-9.]+ ms is [0-9.]+ x the median for $checks checks \\(step $((every * checks));"
[ "$(grep -c '^straggler:' err.txt)" = 1 ] || die "expected one straggler line, got: $(grep '^straggler:' err.txt)"
grep -qE "$pattern" err.txt || die "no line matching /$pattern/"
echo "ok [$case]: rank $slow ($where) named at step $((every * checks))"
