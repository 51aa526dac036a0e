#!/usr/bin/env bash
# tools/run_fuzz.sh: the libFuzzer targets (tests/fuzz) for the parsers of
# files a user may not control, built with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer in build-fuzz/ (the default build is untouched).
#
#   tools/run_fuzz.sh [--seconds N] [ctest arguments...]
#
# Each target replays its seed corpus (tests/fuzz/corpus/<name>/) and then
# fuzzes for N seconds (30 unless given; XIRANG_FUZZ_SECONDS too); a crash,
# a leak, a sanitizer report or an exception other than xirang::Error fails
# its ctest test and leaves the input in build-fuzz/tests/fuzz/<name>/. Exits
# 0 without running anything when clang++ cannot build -fsanitize=fuzzer.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${XIRANG_FUZZ_SECONDS:-30}
if [ "${1:-}" = --seconds ]; then
  seconds=$2
  shift 2
fi
build=${XIRANG_FUZZ_BUILD_DIR:-$root/build-fuzz}
cxx=${XIRANG_FUZZ_CXX:-clang++}
if ! command -v "$cxx" >/dev/null ||
   ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
     "$cxx" -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "run_fuzz: skipped: $cxx cannot build -fsanitize=fuzzer targets (install clang)"
  exit 0
fi
cc=${XIRANG_FUZZ_CC:-${cxx/clang++/clang}}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_C_COMPILER="$cc" -DXIRANG_CUDA=OFF -DXIRANG_FUZZ=ON -DXIRANG_FUZZ_SECONDS="$seconds" >/dev/null
targets=$(sed -n 's/^xirang_fuzz_target(\([a-z_0-9]*\).*/fuzz_\1/p' "$root/tests/fuzz/CMakeLists.txt")
# shellcheck disable=SC2086
cmake --build "$build" -j "${XIRANG_JOBS:-$(nproc)}" --target $targets
cd "$build"
ctest -L fuzz --output-on-failure "$@"
