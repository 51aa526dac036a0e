#!/usr/bin/env bash
# tools/run_sanitizers.sh: the core, kernel, communication (one rank and
# under mpirun), model, runtime and parallel tests built with
# AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer, in
# build-asan/ (the default build is untouched; no CUDA, the sanitizers do
# not see device code).
#
#   tools/run_sanitizers.sh [ctest arguments...]     # default: -L "core|kernels|comm|mpi|models|runtime|parallel"
#
# A sanitizer report fails the test that made it (UBSan halts on its first
# report; ASan on any bad access; LeakSanitizer at exit). Leaks inside the
# libraries Xirang calls (Open MPI and its helpers, OpenMP, oneDNN) are
# theirs and are suppressed by tools/sanitizers/lsan.supp; a leak of ours
# is not, unless it is a handle those libraries allocate (an MPI request, a
# oneDNN primitive), which the suppressions hide as well. Not part of
# CI: on a 2-core machine the build alone takes longer than the whole
# default suite (docs/reliability.md, "Sanitizers").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${XIRANG_ASAN_BUILD_DIR:-$root/build-asan}
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DXIRANG_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build" -j "${XIRANG_JOBS:-$(nproc)}" --target core_tests kernels_tests comm_tests models_tests runtime_tests \
  tp_layer_tests parallel_train_check parallel_step_time_check mpi_comm_tests xirang
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# fast_unwind_on_malloc=0: Open MPI and its plugins are built without frame
# pointers, so the fast unwinder stops one frame into them and their
# allocations look like leaks of nobody; the slow unwinder reaches the
# library frames the suppressions name.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:fast_unwind_on_malloc=0:malloc_context_size=30}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tools/sanitizers/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
cd "$build"
[ $# -gt 0 ] || set -- -L "core|kernels|comm|mpi|models|runtime|parallel"
ctest --output-on-failure -j "${XIRANG_TEST_JOBS:-2}" "$@"
