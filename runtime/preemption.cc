#include "runtime/preemption.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
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
  std::thread catcher([set] {
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    for (;;) pause();  // each signal runs its handler (or default action) here
  });
  pthread_setname_np(catcher.native_handle(), "xirang-signals");
  catcher.detach();
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
