#!/usr/bin/env bash
# Compares two builds of xirang on two-rank layouts of gpt2_debug (d_model
# 128, 4 layers, sequence 128, micro batch 2): for each layout, runs A and B
# alternately (A first in odd pairs, B first in even ones), PAIRS times, and
# prints each run's median step time and its communication parts (over
# steps 5-14 of 14), then the median ratio B/A of step_ms and of each part.
# Alternating in one invocation shares the machine's noise between the two.
#
#   bench/ab_layouts.sh OLD/bin/xirang NEW/bin/xirang [PAIRS] [LAYOUT ...]
#   bench/ab_layouts.sh /tmp/old_xirang build/bin/xirang 5 tp2 pp2 dp2
#
# Layouts: dp2, tp2, pp2 (default: all three). Needs mpirun and python3.
# Run it alone on the machine (on a shared one, as root:
# setsid bash -c 'echo -15 > /proc/self/autogroup; bench/ab_layouts.sh ...').
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 XIRANG_A XIRANG_B [PAIRS] [dp2|tp2|pp2 ...]" >&2
  exit 2
fi
a=$(realpath "$1") b=$(realpath "$2")
shift 2
pairs=3
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  pairs=$1
  shift
fi
layouts=("$@")
[ ${#layouts[@]} -gt 0 ] || layouts=(dp2 tp2 pp2)
for bin in "$a" "$b"; do
  [ -x "$bin" ] || { echo "$0: '$bin' is not an executable" >&2; exit 2; }
done
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$a" data prepare --tokenizer bytes --out data "$src/tests/assets/text/english.txt" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

sets_of() {
  case $1 in
    dp2) echo "parallel.dp=2 train.global_batch=8" ;;
    tp2) echo "parallel.tp=2 train.global_batch=4" ;;
    pp2) echo "parallel.pp=2 train.global_batch=8" ;;
    *) echo "$0: unknown layout '$1' (dp2, tp2 or pp2)" >&2; exit 2 ;;
  esac
}

# run BIN LAYOUT: one line "step_ms tp_comm_ms pp_bubble_ms dp_comm_exposed_ms" (medians).
run() {
  local sets=() kv
  for kv in $(sets_of "$2"); do sets+=(--set "$kv"); done
  rm -f m.jsonl
  mpirun -np 2 --oversubscribe "$1" train "$src/configs/gpt2_debug.yaml" --set data.train=data/train \
    --set train.steps=14 --set model.d_model=128 --set model.n_layer=4 --set model.seq_len=128 \
    --set train.micro_batch=2 --set metrics.jsonl=m.jsonl "${sets[@]}" >/dev/null 2>run.err ||
    { echo "$0: $1 failed on $2: $(tail -3 run.err)" >&2; exit 1; }
  python3 -c '
import json, statistics
rows = [json.loads(l) for l in open("m.jsonl")][4:]
print(" ".join("%.3f" % statistics.median(r.get(k, 0.0) for r in rows)
               for k in ("step_ms", "tp_comm_ms", "pp_bubble_ms", "dp_comm_exposed_ms")))'
}

for lay in "${layouts[@]}"; do
  sets_of "$lay" >/dev/null
  : >ratios.txt
  for i in $(seq 1 "$pairs"); do
    if [ $((i % 2)) = 1 ]; then ra=$(run "$a" "$lay"); rb=$(run "$b" "$lay")
    else rb=$(run "$b" "$lay"); ra=$(run "$a" "$lay"); fi
    echo "$lay pair $i: A [step tp bubble dp_exposed ms] $ra | B $rb"
    paste -d' ' <(echo "$ra") <(echo "$rb") >>ratios.txt
  done
  python3 - "$lay" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open("ratios.txt")]
names = ("step_ms", "tp_comm_ms", "pp_bubble_ms", "dp_comm_exposed_ms")
out = []
for k, name in enumerate(names):
    r = [b[k + 4] / b[k] for b in rows if b[k] > 0.05]
    if r:
        out.append("%s %.3f (min %.3f, max %.3f)" % (name, statistics.median(r), min(r), max(r)))
print("%s: median B/A over %d pairs: %s" % (sys.argv[1], len(rows), "; ".join(out)))
PY
done
