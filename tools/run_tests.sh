#!/usr/bin/env bash
# Set-up, build, and every test through ctest. Works on a fresh machine from
# a clean clone. Extra arguments go to ctest (e.g. -R Config). Without
# arguments, the fuzz targets then run too (tools/run_fuzz.sh: their own
# clang build in build-fuzz/, about 30 s a target; skipped where clang
# cannot build them, or with XIRANG_RUN_FUZZ=0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools/setup.sh
tools/build.sh
# Multi-rank tests run Open MPI as root in containers and CI, oversubscribed.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# tools/setup.sh installed GPT-2's vocabulary (and node): the tokenizer tests
# fail rather than skip without it.
export XIRANG_REQUIRE_VOCAB=1
cd "${XIRANG_BUILD_DIR:-$root/build}"
# Without arguments: every test but the `measurement` ones (live
# measurements of the machine, e.g. plan.calibrate_live; `-L measurement`
# runs them).
if [ $# -eq 0 ]; then set -- -LE measurement; run_fuzz=1; else run_fuzz=0; fi
ctest --output-on-failure -j "${XIRANG_TEST_JOBS:-2}" "$@"
if [ "$run_fuzz" = 1 ] && [ "${XIRANG_RUN_FUZZ:-1}" = 1 ]; then
  "$root/tools/run_fuzz.sh"
fi
