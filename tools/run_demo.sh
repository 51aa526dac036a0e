#!/usr/bin/env bash
# The demo: set-up, build, prepare real English text (the fortunes
# collection), train a small GPT-2 on it, and compare the validation loss
# with a unigram model of the same text.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools/setup.sh
tools/build.sh xirang
xirang=build/bin/xirang

if [ ! -f data/demo/train/index.json ] || [ ! -f data/demo/val/index.json ]; then
  $xirang data prepare --tokenizer bytes --out data/demo --val-fraction 0.05 --force /usr/share/games/fortunes
fi
$xirang train configs/gpt2_demo.yaml "$@"
echo "demo: per-step metrics in runs/demo/metrics.jsonl, data in data/demo"
