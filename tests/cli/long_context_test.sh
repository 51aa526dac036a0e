#!/usr/bin/env bash
# Context parallelism for memory (configs/llama_long_debug.yaml: a narrow
# LLaMA at a 32,768-token context): under memory.limit_gb = 0.08 (81.92 MiB)
# one rank's memory plan (about 127 MiB, nearly all activations) is refused
# with one line before any step; at parallel.cp = 4 each rank holds a quarter
# of every sequence's rows, its plan (about 38 MiB: the activations per
# microbatch fall to exactly a quarter) fits and it trains a step.
# cp4_ring: the same at cp = 4 with parallel.cp_comm = ring, two steps (the
# second's loss follows the first's gradients) against all_gather: losses
# within 1e-5 relative (not bitwise: the ring merges per-block softmaxes).
# Usage: long_context_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
# Exit 77: mpirun is missing.
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1
. "$src/tests/cli/lib.sh"

cfg=$src/configs/llama_long_debug.yaml
common=(--set data.train=data/debug/train --set memory.limit_gb=0.08 --set train.steps=1)
[ -f data/debug/train/index.json ] ||
  "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
    >/dev/null || die "data prepare failed"

case $case in
  one_rank_refused)
    "$xirang" train "$cfg" "${common[@]}" >out.txt 2>err.txt && die "one rank trained under the limit"
    tail -n 1 err.txt | grep -q "^xirang: memory error: the memory plan needs .* but memory.limit_gb allows 81.92 MiB" ||
      die "unexpected error line: $(tail -n 1 err.txt)"
    ! grep -q '^step ' err.txt || die "a step ran before the refusal"
    echo "ok [$case]: $(tail -n 1 err.txt)" ;;
  cp4_trains)
    command -v mpirun >/dev/null || { echo "SKIP [$case]: mpirun is missing"; exit 77; }
    env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 4 --oversubscribe \
      -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1 \
      "$xirang" train "$cfg" "${common[@]}" --set parallel.cp=4 >out.txt 2>err.txt ||
      die "cp=4 failed: $(grep -v '^\[' err.txt | tail -n 3)"
    grep -q 'seq_len 32768 / cp 4' err.txt out.txt || die "the memory plan does not show the cp share"
    grep -q '^trained to step 1 of 1 on 4 ranks' err.txt out.txt || die "no step trained"
    # A quarter of one rank's activations per microbatch (101.50 MiB at cp = 1).
    grep -q '^activations per microbatch: none 25.38 MiB' err.txt out.txt ||
      die "activations per microbatch: $(grep -h '^activations per microbatch' err.txt out.txt)"
    echo "ok [$case]: $(grep -h '^  total' err.txt out.txt | head -n 1)" ;;
  cp4_ring)
    command -v mpirun >/dev/null || { echo "SKIP [$case]: mpirun is missing"; exit 77; }
    for mode in all_gather ring; do
      rm -f "$mode.jsonl"
      env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 4 --oversubscribe \
        -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1 \
        "$xirang" train "$cfg" "${common[@]}" --set train.steps=2 --set parallel.cp=4 --set parallel.cp_comm=$mode \
        --set metrics.jsonl=$mode.jsonl >out.txt 2>err.txt || die "cp=4 $mode failed: $(grep -v '^\[' err.txt | tail -n 3)"
      grep -q '^trained to step 2 of 2 on 4 ranks' err.txt out.txt || die "$mode: no two steps trained"
    done
    python3 - <<'PY' || die "ring and all_gather losses differ"
import json, sys
a = [json.loads(l)["loss"] for l in open("all_gather.jsonl")]
r = [json.loads(l)["loss"] for l in open("ring.jsonl")]
worst = max(abs(x - y) / abs(x) for x, y in zip(a, r))
print("losses all_gather %s ring %s, largest relative difference %.3g" % (a, r, worst))
sys.exit(0 if len(a) == len(r) == 2 and worst <= 1e-5 else 1)
PY
    echo "ok [$case]" ;;
  *) die "unknown case" ;;
esac
