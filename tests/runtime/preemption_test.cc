// The stop vote (runtime/preemption.h): what a max all-reduce of the ranks'
// entries tells every rank, the signal handlers' first-signal record, and
// the routing of the stop signals to a thread that never computes.
#include "runtime/preemption.h"

#include <gtest/gtest.h>
#include <omp.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace xirang {
namespace {

struct FixedSource final : StopSource {
  int signal = 0;
  int pending() const override { return signal; }
};

// The max over the ranks' entries, as the world all-reduce computes it.
double reduced(const std::vector<double>& votes) { return *std::max_element(votes.begin(), votes.end()); }

TEST(StopVote, NoSignalAnywhereIsNoStop) {
  FixedSource none;
  EXPECT_FALSE(stop_of(reduced({stop_vote(&none, 0), stop_vote(nullptr, 1), stop_vote(&none, 70000)})));
}

TEST(StopVote, TheLargestSignalAndTheHighestRankThatGotItWin) {
  FixedSource term, usr1, none;
  term.signal = SIGTERM;
  usr1.signal = SIGUSR1;
  // SIGTERM (15) > SIGUSR1 (10): ranks 3 and 9 got SIGTERM, rank 12 SIGUSR1.
  const StopRequest r = stop_of(reduced({stop_vote(&none, 0), stop_vote(&term, 3), stop_vote(&usr1, 12),
                                         stop_vote(&term, 9), stop_vote(nullptr, 20)}));
  ASSERT_TRUE(r);
  EXPECT_EQ(r.signal, SIGTERM);
  EXPECT_EQ(r.rank, 9);
}

TEST(StopVote, RanksOfALargeWorldComeBackExactly) {
  FixedSource usr1;
  usr1.signal = SIGUSR1;
  for (int rank : {0, 1, 4095, 65535, (1 << 24) - 1}) {
    const StopRequest r = stop_of(stop_vote(&usr1, rank));
    EXPECT_EQ(r.signal, SIGUSR1) << rank;
    EXPECT_EQ(r.rank, rank);
  }
}

extern "C" void sentinel_handler(int) {}

// The handler the process had (a sentinel here, not the default that the
// first signal sets) comes back for both signals, and a second StopSignals
// can be made after the first is gone.
TEST(StopSignals, TheFirstSignalIsRecordedAndTheHandlersAreRestored) {
  struct sigaction sentinel {};
  sentinel.sa_handler = sentinel_handler;
  sigemptyset(&sentinel.sa_mask);
  struct sigaction old_term {}, old_usr1 {};
  sigaction(SIGTERM, &sentinel, &old_term);
  sigaction(SIGUSR1, &sentinel, &old_usr1);
  {
    StopSignals s;
    EXPECT_EQ(s.pending(), 0);
    std::raise(SIGUSR1);
    EXPECT_EQ(s.pending(), SIGUSR1);
    EXPECT_EQ(signal_name(s.pending()), "SIGUSR1");
  }
  for (int sig : {SIGTERM, SIGUSR1}) {
    struct sigaction now {};
    sigaction(sig, nullptr, &now);
    EXPECT_EQ(now.sa_handler, &sentinel_handler) << signal_name(sig);
  }
  {
    StopSignals again;
    EXPECT_EQ(again.pending(), 0);
  }
  sigaction(SIGTERM, &old_term, nullptr);
  sigaction(SIGUSR1, &old_usr1, nullptr);
}

// ---- Routing (route_stop_signals). Each case runs in a process of its own
// (a threadsafe death test re-runs the binary for it), since routing blocks
// the signals in the process's main thread for good.

std::atomic<int> g_taken{0}, g_taken_elsewhere{0};

// Counts the signals it takes, and those taken by any thread but the catcher.
extern "C" void counting_handler(int) {
  g_taken.fetch_add(1);
  char name[32] = {};
  prctl(PR_GET_NAME, name);
  if (std::strcmp(name, "xirang-signals") != 0) g_taken_elsewhere.fetch_add(1);
}

// A second thread sends SIGUSR1 to the process every 20 us while the main
// thread and an OpenMP worker run matrix products (on oneDNN where the build
// has it: its JIT kernels point the stack pointer into the heap). Exits 0
// when every product equals the one made before the storm, signals came, and
// none ran outside the catcher.
[[noreturn]] void signal_storm(bool route) {
  if (route) route_stop_signals();
  const int open = threads_taking_stop_signals();
  omp_set_num_threads(2);
  struct sigaction sa {};
  sa.sa_handler = counting_handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, nullptr);
  const auto path = cpu::have_onednn() ? cpu::GemmPath::OneDnn : cpu::GemmPath::OpenBlas;
  struct Shape {
    int64_t m, n, k;
  };
  const std::vector<Shape> shapes = {{64, 256, 64}, {64, 64, 256}, {256, 768, 768}, {512, 64, 64}};
  std::mt19937 rng(17);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<std::vector<float>> a, b, want;
  for (const Shape& sh : shapes) {
    a.emplace_back(size_t(sh.m * sh.k));
    b.emplace_back(size_t(sh.k * sh.n));
    for (float& x : a.back()) x = dist(rng);
    for (float& x : b.back()) x = dist(rng);
    want.emplace_back(size_t(sh.m * sh.n));
    cpu::sgemm_on(path, false, false, sh.m, sh.n, sh.k, 1.f, a.back().data(), sh.k, b.back().data(), sh.n, 0.f,
                  want.back().data(), sh.n);
  }
  std::atomic<bool> stop{false};
  std::thread sender([&] {
    while (!stop.load()) {
      kill(getpid(), SIGUSR1);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  int wrong = 0;
  std::vector<float> c;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < until)
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape& sh = shapes[i];
      c.assign(size_t(sh.m * sh.n), 0.f);
      cpu::sgemm_on(path, false, false, sh.m, sh.n, sh.k, 1.f, a[i].data(), sh.k, b[i].data(), sh.n, 0.f, c.data(),
                    sh.n);
      wrong += c != want[i];
    }
  stop = true;
  sender.join();
  std::fprintf(stderr, "threads taking the signals %d; signals taken %d, outside the catcher %d; products differing %d\n",
               open, g_taken.load(), g_taken_elsewhere.load(), wrong);
  std::_Exit(open == 1 && g_taken.load() >= 100 && g_taken_elsewhere.load() == 0 && wrong == 0 ? 0 : 3);
}

TEST(StopSignalRouting, AStormOfSignalsNeverLandsOnAComputingThread) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(signal_storm(true), testing::ExitedWithCode(0),
              "threads taking the signals 1; .* outside the catcher 0; products differing 0");
}

// The failure the routing prevents, kept to reproduce it (run with
// --gtest_also_run_disabled_tests): with oneDNN's JIT sgemm on the main
// thread, the storm corrupts the heap ("corrupted size vs. prev_size", SIGABRT)
// within a fraction of a second (or a later access faults: SIGSEGV).
TEST(StopSignalRouting, DISABLED_WithoutRoutingTheStormCorruptsTheHeap) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(signal_storm(false), [](int status) { return WIFSIGNALED(status); }, "");
}

// Routed and armed: the first SIGUSR1 is recorded (taken by the catcher),
// the second ends the process; with no StopSignals, SIGTERM ends it at once.
[[noreturn]] void first_recorded_second_ends(bool arm) {
  route_stop_signals();
  if (!arm) {
    kill(getpid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(0);
  }
  StopSignals s;
  kill(getpid(), SIGUSR1);
  for (int i = 0; i < 2000 && s.pending() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::fprintf(stderr, "pending %d\n", s.pending());
  if (s.pending() != SIGUSR1) std::_Exit(3);
  kill(getpid(), SIGUSR1);
  std::this_thread::sleep_for(std::chrono::seconds(10));
  std::_Exit(0);
}

TEST(StopSignalRouting, FirstSignalIsRecordedSecondEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(first_recorded_second_ends(true), testing::KilledBySignal(SIGUSR1),
              "pending " + std::to_string(SIGUSR1));
  EXPECT_EXIT(first_recorded_second_ends(false), testing::KilledBySignal(SIGTERM), "");
}

// A signal that comes while both are blocked and no catcher runs yet waits
// for the catcher, which then takes it (here with the default action).
[[noreturn]] void signal_before_the_catcher() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  kill(getpid(), SIGTERM);
  route_stop_signals();
  std::this_thread::sleep_for(std::chrono::seconds(10));
  std::_Exit(0);
}

TEST(StopSignalRouting, ASignalBeforeTheCatcherIsNotLost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(signal_before_the_catcher(), testing::KilledBySignal(SIGTERM), "");
}

}  // namespace
}  // namespace xirang
