#!/usr/bin/env bash
# The demo: set-up, build, prepare real English text (the fortunes
# collection), train a small GPT-2 on it with two data-parallel ranks under
# mpirun, and compare the validation loss with a unigram model of the same
# text. Extra arguments go to `xirang train` (e.g. --set train.steps=50).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools/setup.sh
tools/build.sh xirang
xirang=build/bin/xirang
ranks=${XIRANG_DEMO_RANKS:-2}

if [ ! -f data/demo_gpt2/train/index.json ] || [ ! -f data/demo_gpt2/val/index.json ]; then
  $xirang data prepare --tokenizer gpt2 --out data/demo_gpt2 --val-fraction 0.05 --force /usr/share/games/fortunes
fi
# Open MPI refuses to run as root unless told; containers and CI run as root.
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# One compute thread per rank: the ranks share the machine's cores.
threads=$(( $(nproc) / ranks )); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
mpirun -np "$ranks" --oversubscribe "$xirang" train configs/gpt2_demo.yaml "$@"
echo "demo: per-step metrics in runs/demo/metrics.jsonl, data in data/demo_gpt2"
