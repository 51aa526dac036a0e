#!/usr/bin/env bash
# A fault on one rank ends the whole job with a clear message, within the
# communication timeout; never a hang.
# Usage: fault_test.sh MPIEXEC XIRANG SOURCE_DIR DATA_DIR KIND
set -uo pipefail
mpiexec=$1 xirang=$2 src=$3 data=$4 kind=$5
timeout_s=8
start=$(date +%s)
timeout 120 "$mpiexec" -np 3 --oversubscribe "$xirang" train "$src/configs/gpt2_debug.yaml" \
  --set train.global_batch=6 --set train.micro_batch=1 --set train.steps=6 \
  --set data.train="$data/train" --set comm.timeout_s=$timeout_s \
  --set faults.kind="$kind" --set faults.rank=1 --set faults.step=3 >out.txt 2>err.txt
rc=$?
elapsed=$(( $(date +%s) - start ))
cat err.txt
[ $rc -ne 0 ] || { echo "FAIL: the job succeeded despite the fault"; exit 1; }
[ $rc -ne 124 ] || { echo "FAIL: the job hung (killed by the test's own 120 s timeout)"; exit 1; }
case $kind in
  kill) pattern='signal 9|Killed|killed' ;;
  hang) pattern="did not complete within $timeout_s s" ;;
  fail_transfer) pattern='injected transfer failure' ;;
esac
grep -qE "$pattern" err.txt || { echo "FAIL: no message matching /$pattern/ on stderr"; exit 1; }
# Generous bound: start-up, 2 steps, the timeout, and the abort.
[ $elapsed -le $((timeout_s + 45)) ] || { echo "FAIL: took ${elapsed}s"; exit 1; }
echo "ok: $kind on rank 1 ended the job in ${elapsed}s with exit code $rc"
