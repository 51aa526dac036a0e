#include "runtime/preemption.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>

#include "core/error.h"

namespace xirang {

namespace {

// A signal handler can only reach globals; it stores the signal and nothing else.
std::atomic<int> g_pending{0};
std::atomic<bool> g_installed{false};
struct sigaction g_old_term, g_old_usr1;

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  g_pending.compare_exchange_strong(expected, sig);
  // A second SIGTERM or SIGUSR1 takes the default action (the process ends
  // at once): sigaction is async-signal-safe.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGTERM, &dfl, nullptr);
  sigaction(SIGUSR1, &dfl, nullptr);
}

constexpr char kCatcherName[] = "xirang-signals";

sigset_t stop_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);
  return set;
}

}  // namespace

void route_stop_signals() {
  static std::atomic<bool> routed{false};
  if (routed.exchange(true)) return;
  const sigset_t set = stop_signal_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // The catcher unblocks them for itself alone; a signal that comes before
  // it does waits, pending, for it.
  std::promise<void> ready;
  std::future<void> up = ready.get_future();
  std::thread catcher([set, ready = std::move(ready)]() mutable {
    pthread_setname_np(pthread_self(), kCatcherName);
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    ready.set_value();
    for (;;) pause();  // each signal runs its handler (or default action) here
  });
  catcher.detach();
  up.wait();
  // A library that starts threads before main (the pthreads build of
  // OpenBLAS does) leaves them open to both signals; they then take them.
  const int others = threads_taking_stop_signals() - 1;
  if (others > 0)
    std::fprintf(stderr,
                 "xirang: warning: %d thread%s started before the stop signals were routed still take SIGTERM "
                 "and SIGUSR1 (the pthreads build of OpenBLAS starts its threads before main; the OpenMP build "
                 "does not)\n",
                 others, others == 1 ? "" : "s");
}

int threads_taking_stop_signals() {
  const unsigned long long bits = (1ull << (SIGTERM - 1)) | (1ull << (SIGUSR1 - 1));
  int open = 0;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream in(task.path() / "status");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("SigBlk:", 0) == 0) {
        if ((std::stoull(line.substr(7), nullptr, 16) & bits) != bits) ++open;
        break;
      }
  }
  return open;
}

StopSignals::StopSignals() {
  if (g_installed.exchange(true)) fail(ErrorKind::Internal, "StopSignals: the handlers are already installed");
  g_pending = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // system calls in flight (file writes, waits) go on
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
  g_installed = false;
}

int StopSignals::pending() const { return g_pending.load(std::memory_order_relaxed); }

// One double carries both: the signal in the high part, the rank below it
// (exact in a double for any real world size); -1 when no signal came.
constexpr double kRanks = 1 << 24;

double stop_vote(const StopSource* source, int world_rank) {
  const int sig = source ? source->pending() : 0;
  return sig > 0 ? sig * kRanks + world_rank : -1.0;
}

StopRequest stop_of(double v) {
  if (v < 0) return {};
  StopRequest r;
  r.signal = int(v / kRanks);
  r.rank = int(v - r.signal * kRanks);
  return r;
}

std::string signal_name(int signal) {
  if (signal == SIGTERM) return "SIGTERM";
  if (signal == SIGUSR1) return "SIGUSR1";
  return str_cat("signal ", signal);
}

}  // namespace xirang
