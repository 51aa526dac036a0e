#!/usr/bin/env bash
# Configures and builds Xirang into build/ (or $XIRANG_BUILD_DIR).
# Usage: tools/build.sh [ninja targets...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${XIRANG_BUILD_DIR:-$root/build}
jobs=${XIRANG_JOBS:-$(nproc)}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${XIRANG_CMAKE_ARGS:-} >/dev/null
fi
if [ $# -gt 0 ]; then
  cmake --build "$build" -j "$jobs" --target "$@"
else
  cmake --build "$build" -j "$jobs"
fi
