#include "core/host_cpus.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <bitset>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

namespace xirang {

std::vector<uint64_t> affinity_words() {
  // A dynamically sized set: machines with more CPUs than cpu_set_t's 1024 exist.
  for (int ncpu = 1024; ncpu <= (1 << 16); ncpu *= 4) {
    cpu_set_t* set = CPU_ALLOC(size_t(ncpu));
    if (!set) break;
    const size_t bytes = CPU_ALLOC_SIZE(size_t(ncpu));
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<uint64_t> words((size_t(ncpu) + 63) / 64, 0);
      for (int c = 0; c < ncpu; ++c)
        if (CPU_ISSET_S(size_t(c), bytes, set)) words[size_t(c) / 64] |= uint64_t(1) << (c % 64);
      CPU_FREE(set);
      return words;
    }
    CPU_FREE(set);
  }
  const long online = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  std::vector<uint64_t> words((size_t(online) + 63) / 64, 0);
  for (long c = 0; c < online; ++c) words[size_t(c) / 64] |= uint64_t(1) << (c % 64);
  return words;
}

int count_cpus(const std::vector<uint64_t>& words) {
  int n = 0;
  for (uint64_t w : words) n += int(std::bitset<64>(w).count());
  return n;
}

namespace {

// "max 100000" or "QUOTA PERIOD" (cgroup v2 cpu.max): whole CPUs, 0 for none.
int cpus_of_cpu_max(const std::string& path) {
  std::ifstream in(path);
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max" || !(period > 0)) return 0;
  const double q = std::atof(quota.c_str());
  return q > 0 ? std::max(1, int(std::ceil(q / period))) : 0;
}

}  // namespace

int cgroup_cpu_quota() {
  // cgroup v2: the line "0::PATH" of /proc/self/cgroup; a limit anywhere up the path applies.
  std::ifstream cg("/proc/self/cgroup");
  std::string line, v2_path;
  while (std::getline(cg, line))
    if (line.rfind("0::", 0) == 0) v2_path = line.substr(3);
  int best = 0;
  auto take = [&](int q) {
    if (q > 0) best = best == 0 ? q : std::min(best, q);
  };
  if (!v2_path.empty()) {
    std::string p = v2_path;
    for (;;) {
      take(cpus_of_cpu_max("/sys/fs/cgroup" + (p == "/" ? std::string() : p) + "/cpu.max"));
      if (p.empty() || p == "/") break;
      const size_t slash = p.find_last_of('/');
      p = slash == 0 || slash == std::string::npos ? "/" : p.substr(0, slash);
    }
    if (best > 0) return best;
  }
  // cgroup v1 (or a hybrid mount), as seen inside a container: the process's own group at the mount point.
  std::ifstream q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), per("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double quota = 0, period = 0;
  if (q >> quota && per >> period && quota > 0 && period > 0) take(int(std::ceil(quota / period)));
  return best;
}

}  // namespace xirang
