// The stop vote (runtime/preemption.h): what a max all-reduce of the ranks'
// entries tells every rank, and the signal handlers' first-signal record.
#include "runtime/preemption.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <vector>

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

}  // namespace
}  // namespace xirang
