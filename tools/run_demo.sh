#!/usr/bin/env bash
# The demo: set-up, build, prepare real English text (the fortunes
# collection), train a small GPT-2 on it with two data-parallel ranks under
# mpirun, compare the validation loss with a unigram model of the same
# text, and print a short sample of the trained model's text (`xirang
# generate` from the final checkpoint, runs/demo/ckpt). Extra arguments go to
# `xirang train` (e.g. --set train.steps=50).
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
# Each demo run trains afresh and saves its final step (replacing an earlier run's).
mpirun -np "$ranks" --oversubscribe "$xirang" train configs/gpt2_demo.yaml \
  --set checkpoint.dir=runs/demo/ckpt --set checkpoint.resume=none "$@"
echo "demo: per-step metrics in runs/demo/metrics.jsonl, data in data/demo_gpt2, checkpoint in runs/demo/ckpt"
# A sample from the trained model: one rank, every core, a fixed seed (the same text on every run of
# the same checkpoint, whatever the thread count).
echo "demo: a sample of 40 tokens (temperature 0.8, top-k 40, seed 1):"
OMP_NUM_THREADS=$(nproc) OPENBLAS_NUM_THREADS=$(nproc) "$xirang" generate configs/gpt2_demo.yaml \
  --checkpoint runs/demo/ckpt --prompt "The meaning of life is" --max-new-tokens 40 --temperature 0.8 --top-k 40 \
  --seed 1
