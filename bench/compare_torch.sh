#!/usr/bin/env bash
# Xirang against PyTorch on the same cores: the same GPT-2 shapes trained by
# build/bin/train_bench and by bench/torch_gpt2.py, alternating in one
# invocation (the machine is shared and noisy), with the median ratio of
# tokens/s over the pairs.
#
#   bench/compare_torch.sh [--pairs 3] [--threads 2] [--steps 4] [--set section.key=value ...]
#
# Rows (issue 18's): gpt2_124m at B 4 x T 64, and 4 layers of d_model 256
# (4 heads, the GPT-2 vocabulary) at B 8 x T 256. Both run fp32 on
# `--threads` threads. PyTorch is given what suits it best on a CPU:
# jemalloc preloaded with decay off (when libjemalloc2 is installed),
# OMP_WAIT_POLICY=PASSIVE, foreach AdamW. Xirang runs as train_bench does
# (OMP_NUM_THREADS and OPENBLAS_NUM_THREADS = threads); extra --set
# options go to train_bench (e.g. --set precision.dtype=bf16). Needs Debian's
# python3-torch (exit 77 with a message when it is absent).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pairs=3 threads=2 steps=4 sets=()
while [ $# -gt 0 ]; do
  case $1 in
    --pairs) pairs=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    *) echo "compare_torch: unknown option '$1' (expected --pairs, --threads, --steps, --set)" >&2; exit 2 ;;
  esac
done
py=/usr/bin/python3
"$py" -c "import torch" 2>/dev/null || { echo "compare_torch: PyTorch is not installed (apt-get install python3-torch)"; exit 77; }
bench=$root/build/bin/train_bench
[ -x "$bench" ] || { echo "compare_torch: $bench is missing (tools/build.sh train_bench)"; exit 2; }
jemalloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
torch_env=(OMP_NUM_THREADS=$threads OMP_WAIT_POLICY=PASSIVE)
[ -f "$jemalloc" ] && torch_env+=(LD_PRELOAD=$jemalloc MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1)

# name | train_bench arguments | torch_gpt2.py arguments
rows=(
  "gpt2_124m, B 4 x T 64|--shapes 4x64|--n-layer 12 --d-model 768 --n-head 12 --batch 4 --seq 64"
  "4 layers, d_model 256, B 8 x T 256|--shapes 8x256 --set model.n_layer=4 --set model.d_model=256 --set model.n_head=4|--n-layer 4 --d-model 256 --n-head 4 --batch 8 --seq 256"
)

echo "compare_torch: $(date -u +%Y-%m-%dT%H:%MZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, $threads threads, $pairs pairs, $steps timed steps per run"
[ -f "$jemalloc" ] || echo "(libjemalloc2 not installed: PyTorch runs with glibc malloc)"
echo "| model, batch | Xirang tokens/s (per pair) | PyTorch tokens/s (per pair) | ratio per pair | median ratio |"
echo "|---|---|---|---|---|"
for row in "${rows[@]}"; do
  IFS='|' read -r name xargs targs <<<"$row"
  xs=() ts=() rs=()
  for ((i = 0; i < pairs; i++)); do
    # shellcheck disable=SC2086
    x=$(OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads "$bench" --steps "$steps" $xargs "${sets[@]}" 2>/dev/null |
        awk -F'|' '/^\| [0-9]+ x [0-9]+ \|/ {gsub(/ /, "", $5); print $5}')
    # shellcheck disable=SC2086
    t=$(env "${torch_env[@]}" "$py" "$root/bench/torch_gpt2.py" $targs --steps "$steps" --threads "$threads" |
        "$py" -c "import json,sys; print(round(json.load(sys.stdin)['tokens_per_s']))")
    [ -n "$x" ] && [ -n "$t" ] || { echo "compare_torch: a run failed (xirang '$x', torch '$t')" >&2; exit 1; }
    xs+=("$x") ts+=("$t") rs+=("$("$py" -c "print(f'{$x / $t:.3f}')")")
  done
  med=$(printf '%s\n' "${rs[@]}" | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
  echo "| $name | ${xs[*]} | ${ts[*]} | ${rs[*]} | $med |"
done
