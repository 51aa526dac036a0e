// Tests of all_to_all_v on the thread group of tests/support/thread_group.h
// (ranks as threads, no MPI), which layer tests use to run expert
// parallelism's dispatch and combine: rows land where the counts say, bit
// for bit in any dtype, and counts that disagree between a sender and a
// receiver fail every rank instead of leaving rows stale.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/rng.h"
#include "tests/support/expect_error.h"
#include "tests/support/thread_group.h"

namespace xirang {
namespace {

int64_t rows_between(int src, int dst) { return int64_t(rng_below(31, uint64_t(src), uint64_t(dst), 4)); }

// Rank r's row k of its chunk for d holds the u16 words (r, d, k, j).
uint16_t word(int src, int dst, int64_t k, int64_t j) { return uint16_t(((src * 8 + dst) * 64 + k) * 4 + j); }

TEST(ThreadAllToAllV, RowsLandWhereTheCountsSay) {
  const int n = 4;
  ThreadWorld world(n);
  std::vector<std::vector<uint16_t>> got(n);
  run_ranks(n, [&](int r) {
    auto c = world.comm(r, "ep");
    std::vector<int64_t> send_counts(n);
    std::vector<uint16_t> send;
    for (int d = 0; d < n; ++d) {
      send_counts[size_t(d)] = rows_between(r, d);
      for (int64_t k = 0; k < send_counts[size_t(d)]; ++k)
        for (int64_t j = 0; j < 4; ++j) send.push_back(word(r, d, k, j));
    }
    const std::vector<int64_t> recv_counts = c->exchange_counts(send_counts);
    int64_t rows = 0;
    for (int q = 0; q < n; ++q) {
      EXPECT_EQ(recv_counts[size_t(q)], rows_between(q, r));
      rows += recv_counts[size_t(q)];
    }
    got[size_t(r)].assign(size_t(rows * 4), 0xffff);
    c->all_to_all_v(Tensor(send.data(), {int64_t(send.size()) / 4, 4}, DType::BF16), send_counts,
                    Tensor(got[size_t(r)].data(), {rows, 4}, DType::BF16), recv_counts);
  });
  for (int d = 0; d < n; ++d) {
    std::vector<uint16_t> want;
    for (int q = 0; q < n; ++q)
      for (int64_t k = 0; k < rows_between(q, d); ++k)
        for (int64_t j = 0; j < 4; ++j) want.push_back(word(q, d, k, j));
    EXPECT_EQ(got[size_t(d)], want) << "rank " << d;
  }
}

TEST(ThreadAllToAllV, DisagreeingCountsFailEveryRank) {
  ThreadWorld world(2, 5);
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int r) {
    auto c = world.comm(r, "ep");
    // Both send 1 row to rank 0 and 2 to rank 1, but rank 1 expects 1 from
    // rank 0 (each side's sums and own rows are consistent: only the pair disagrees).
    const std::vector<int64_t> sc = {1, 2}, rc = r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1, 2};
    std::vector<float> send(3, 1.0f), recv(size_t(rc[0] + rc[1]), 0.0f);
    try {
      c->all_to_all_v(Tensor(send.data(), {3}, DType::F32), sc, Tensor(recv.data(), {rc[0] + rc[1]}, DType::F32), rc);
    } catch (const Error& e) {
      errors[size_t(r)] = e.what();
    }
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("all_to_all_v: rank 0 sends 2 rows to rank 1, which expects 1"), std::string::npos) << e;
}

}  // namespace
}  // namespace xirang
