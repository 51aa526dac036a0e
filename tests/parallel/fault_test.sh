#!/usr/bin/env bash
# A fault on one rank ends the whole job with a clear message, within the
# communication timeout; never a hang. After a hang, the ranks that timed
# out have written their comm traces and `xirang diagnose` names rank 1.
# Usage: fault_test.sh MPIEXEC XIRANG SOURCE_DIR DATA_DIR KIND
#   KIND: kill, hang, fail_transfer (dp3), or hang_pp2 (rank 1 of pp2 hangs)
set -uo pipefail
mpiexec=$1 xirang=$2 src=$3 data=$4 kind=$5
timeout_s=8
layout=(-np 3) fault=$kind batch=6
[ "$kind" = hang_pp2 ] && layout=(-np 2) fault=hang batch=4
traces=traces_$kind
rm -rf "$traces"
start=$(date +%s)
timeout 75 "$mpiexec" "${layout[@]}" --oversubscribe "$xirang" train "$src/configs/gpt2_debug.yaml" \
  --set train.global_batch=$batch --set train.micro_batch=1 --set train.steps=6 \
  --set data.train="$data/train" --set comm.timeout_s=$timeout_s --set comm.trace_dir="$traces" \
  $([ "$kind" = hang_pp2 ] && echo --set parallel.pp=2) \
  --set faults.kind="$fault" --set faults.rank=1 --set faults.step=3 >out.txt 2>err.txt
rc=$?
elapsed=$(( $(date +%s) - start ))
cat err.txt
[ $rc -ne 0 ] || { echo "FAIL: the job succeeded despite the fault"; exit 1; }
[ $rc -ne 124 ] || { echo "FAIL: the job hung (killed by the test's own 75 s timeout)"; exit 1; }
case $kind in
  kill) pattern='signal 9|Killed|killed' ;;
  hang) pattern="did not complete within $timeout_s s.*collective #[0-9]+ of this dp channel.*comm_trace.rank[02].json" ;;
  hang_pp2) pattern="pp recv .* from rank 1 .*did not complete within $timeout_s s.*world rank 1, which never sent it.*comm_trace.rank0.json" ;;
  fail_transfer) pattern='injected transfer failure' ;;
esac
grep -qE "$pattern" err.txt || { echo "FAIL: no message matching /$pattern/ on stderr"; exit 1; }
# Generous bound: start-up, 2 steps, the timeout, and the abort.
[ $elapsed -le $((timeout_s + 45)) ] || { echo "FAIL: took ${elapsed}s"; exit 1; }
case $kind in
  hang|hang_pp2)
    # The hanging rank never times out, so it writes no trace; the others do.
    expect=$([ "$kind" = hang ] && echo "0 2" || echo 0)
    for r in $expect; do
      [ -s "$traces/comm_trace.rank$r.json" ] || { echo "FAIL: no comm trace from rank $r: $(ls "$traces")"; exit 1; }
    done
    [ ! -e "$traces/comm_trace.rank1.json" ] || { echo "FAIL: the hanging rank 1 wrote a trace"; exit 1; }
    "$xirang" diagnose "$traces" >diag.txt 2>&1 || { echo "FAIL: diagnose failed: $(cat diag.txt)"; exit 1; }
    cat diag.txt
    want=$([ "$kind" = hang ] && echo "ranks 0 2 wait for it in dp all_reduce #" || echo "rank 0 waits for it in pp recv")
    grep -q "^summary: rank 1 is behind: $want" diag.txt || { echo "FAIL: diagnose did not name rank 1 at /$want/"; exit 1; } ;;
esac
echo "ok: $kind on rank 1 ended the job in ${elapsed}s with exit code $rc"
