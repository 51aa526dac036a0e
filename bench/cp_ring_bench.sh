#!/usr/bin/env bash
# The context-parallel key/value exchange that the step does not hide:
# parallel.cp_comm = all_gather against ring (models/layers/cp_comm.h) at
# cp = 2 and 4, on loopback and through the simulated slow link
# (comm/simulated_link.h: comm.latency_us, comm.bandwidth_gbps), one
# xirang train run each on llama_debug at a long-ish context (the layout
# of docs/performance_parallel.md's cp section). Prints per run the median
# step_ms and cp_comm_ms (the step's time blocked in cp waits: the exposed
# exchange) over steps 2..STEPS of world rank 0's metrics.jsonl, its share
# of the step, then ring / all_gather ratios per cp and link.
#
#   bench/cp_ring_bench.sh build/bin/xirang [STEPS] [SEQ]      # defaults 6 1024
#
# Needs mpirun and python3; one thread per rank (OMP_NUM_THREADS=1).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 XIRANG [STEPS] [SEQ]" >&2; exit 2; }
xirang=$(realpath "$1") steps=${2:-6} seq=${3:-1024}
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$xirang" data prepare --tokenizer bytes --out data "$src/tests/assets/text/english.txt" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# run CP MODE LINK: one line "step_ms cp_comm_ms" (medians of steps 2..STEPS).
run() {
  local link=()
  [ "$3" = slow ] && link=(--set comm.latency_us=200 --set comm.bandwidth_gbps=0.1)
  rm -f m.jsonl
  mpirun -np "$1" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1 \
    "$xirang" train "$src/configs/llama_debug.yaml" --set data.train=data/train --set model.seq_len="$seq" \
    --set train.global_batch=2 --set train.steps="$steps" --set parallel.cp="$1" --set parallel.cp_comm="$2" \
    --set metrics.jsonl=m.jsonl "${link[@]}" >/dev/null 2>run.err ||
    { echo "$0: cp $1 $2 $3 failed: $(tail -3 run.err)" >&2; exit 1; }
  python3 -c '
import json, statistics
rows = [json.loads(l) for l in open("m.jsonl")][1:]
print("%.1f %.1f" % tuple(statistics.median(r.get(k, 0.0) for r in rows) for k in ("step_ms", "cp_comm_ms")))'
}

printf '%-4s %-6s %-10s %9s %11s %7s\n' cp link cp_comm step_ms cp_comm_ms share
declare -A res
for link in loopback slow; do
  for c in 2 4; do
    for mode in all_gather ring; do
      read -r step comm < <(run "$c" "$mode" "$link")
      res[$c.$link.$mode]="$step $comm"
      printf '%-4s %-6s %-10s %9s %11s %6.1f%%\n' "$c" "${link/loopback/loop}" "$mode" "$step" "$comm" \
        "$(python3 -c "print(100 * $comm / $step)")"
    done
  done
done
echo "ring / all_gather:"
for link in loopback slow; do
  for c in 2 4; do
    read -r s0 c0 <<<"${res[$c.$link.all_gather]}"
    read -r s1 c1 <<<"${res[$c.$link.ring]}"
    python3 -c "print('cp %d %-8s step %.3f  exposed cp_comm %.3f' % ($c, '$link', $s1 / $s0, $c1 / max($c0, 1e-9)))"
  done
done
