// core/host_cpus.h: the CPUs this process may run on, for deciding whether a
// node's ranks have CPUs of their own (comm: CommOptions::busy_poll).
//
//   std::vector<uint64_t> w = affinity_words();  // OR these across a node's ranks,
//   int cpus = count_cpus(w);                    // then count
//   if (int q = cgroup_cpu_quota()) cpus = std::min(cpus, q);
#pragma once

#include <cstdint>
#include <vector>

namespace xirang {

// The calling thread's CPU affinity mask as 64-bit words (bit i%64 of word
// i/64 is CPU i), so that the masks of several processes can be OR-ed (an
// MPI_BOR all-reduce). Where the mask cannot be read, every online CPU.
std::vector<uint64_t> affinity_words();
int count_cpus(const std::vector<uint64_t>& words);

// The CPU quota of this process's control group, rounded up to whole CPUs
// (cgroup v2 cpu.max, the smallest along its path; v1 cpu.cfs_quota_us over
// cpu.cfs_period_us); 0 when there is none or it cannot be read. Docker's
// --cpus and Kubernetes CPU limits set it; they do not change the affinity.
int cgroup_cpu_quota();

}  // namespace xirang
