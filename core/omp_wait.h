// core/omp_wait.h: OpenMP's wait policy for a process whose environment
// sets none.
//
// GNU OpenMP's idle workers spin for a while before they sleep (the default
// wait policy). Where OpenBLAS is its pthread build, the CPU kernels
// alternate OpenMP regions with OpenBLAS products on OpenBLAS's own threads,
// so on a machine with few cores the spinning workers take the cores from
// the threads doing the work: gpt2_debug trains 2-3x slower, gpt2_124m 1.3x
// (docs/performance.md). With OpenBLAS's OpenMP build and oneDNN (one pool)
// both policies measure the same; PASSIVE stays, kinder to shared cores. The
// policy is read once, when the OpenMP runtime loads, so a program that
// wants PASSIVE (sleep at once) must have it in its environment from the
// start:
//
//   int main(int argc, char** argv) {
//     xirang::restart_with_passive_omp_wait(argv);  // first thing; MPI after it
//
// A set OMP_WAIT_POLICY (any value) is left alone.
#pragma once

namespace xirang {

// When OMP_WAIT_POLICY is unset: sets it to PASSIVE and replaces this
// process with a fresh image of the same program, arguments and environment
// (execv of /proc/self/exe: same process id, so launchers such as mpirun
// still see their child). If that fails the process goes on as it was.
void restart_with_passive_omp_wait(char** argv);

}  // namespace xirang
