#!/usr/bin/env bash
# Compares the training throughput of two builds on this machine: runs
# train_bench of build A and of build B alternately, PAIRS times, and prints
# each pair's tokens/s ratio B/A per shape and the median ratio. Alternating
# in one invocation shares the machine's noise between the two.
#
#   bench/ab_train_bench.sh OLD/bin/train_bench NEW/bin/train_bench [PAIRS] [train_bench options...]
#   bench/ab_train_bench.sh /tmp/old/train_bench build/bin/train_bench 5 --steps 6 --shapes 4x64
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 TRAIN_BENCH_A TRAIN_BENCH_B [PAIRS] [train_bench options...]" >&2
  exit 2
fi
a=$1 b=$2
shift 2
pairs=3
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  pairs=$1
  shift
fi
for bin in "$a" "$b"; do
  [ -x "$bin" ] || { echo "$0: '$bin' is not an executable" >&2; exit 2; }
done
# tokens/s per shape from a train_bench table: "shape tokens_per_s" lines.
rates() { awk -F'|' '/^\| [0-9]+ x [0-9]+ \|/ { gsub(/ /, "", $2); gsub(/ /, "", $5); print $2, $5 }'; }
ratios=$(mktemp)
trap 'rm -f "$ratios"' EXIT
for i in $(seq 1 "$pairs"); do
  ra=$("$a" "$@" | rates)
  rb=$("$b" "$@" | rates)
  join <(sort <<<"$ra") <(sort <<<"$rb") | while read -r shape ta tb; do
    r=$(awk -v x="$tb" -v y="$ta" 'BEGIN { printf "%.4f", x / y }')
    echo "pair $i: $shape A $ta tokens/s, B $tb tokens/s, B/A $r"
    echo "$shape $r" >>"$ratios"
  done
done
for shape in $(cut -d' ' -f1 "$ratios" | sort -u); do
  awk -v s="$shape" '$1 == s { print $2 }' "$ratios" | sort -n |
    awk -v s="$shape" '{ v[NR] = $1 } END { printf "%s: median B/A over %d pairs %.4f (min %.4f, max %.4f)\n", s, NR, v[int((NR + 1) / 2)], v[1], v[NR] }'
done
