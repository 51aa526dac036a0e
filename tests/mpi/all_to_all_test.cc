// Tests of all_to_all_v and exchange_counts (expert parallelism's dispatch
// and combine) on the MPI backend, a SimulatedLink over it and the group of
// one. The reference is built from every rank's send buffer and counts,
// gathered with plain MPI calls (not the communicator under test); results
// must match it bit for bit, since an all-to-all only moves bytes.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/comm_trace.h"
#include "comm/mpi_communicator.h"
#include "comm/simulated_link.h"
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

// Rows rank `src` sends to rank `dst`: random in [0, 6], zero for about a
// quarter of the pairs, and none at all from the rank `silent` (one peer
// sending nothing).
int64_t rows_between(uint64_t seed, int src, int dst, int silent) {
  if (src == silent) return 0;
  const uint64_t k = rng_below(seed, uint64_t(src), uint64_t(dst), 28);
  return k < 7 ? 0 : int64_t(k % 7);
}

// Every rank's send buffer and send counts, gathered with MPI_Allgather(v).
struct Gathered {
  std::vector<std::vector<int64_t>> counts;  // [src][dst]
  std::vector<std::vector<uint8_t>> bytes;   // [src]: its send buffer
};

Gathered gather_sends(const std::vector<int64_t>& counts, const std::vector<uint8_t>& bytes) {
  const int p = world_size();
  Gathered g;
  std::vector<int64_t> all(size_t(p) * size_t(p));
  MPI_Allgather(counts.data(), p, MPI_INT64_T, all.data(), p, MPI_INT64_T, MPI_COMM_WORLD);
  int mine = int(bytes.size());
  std::vector<int> sizes(static_cast<size_t>(p)), displs(static_cast<size_t>(p), 0);
  MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int r = 1; r < p; ++r) displs[size_t(r)] = displs[size_t(r) - 1] + sizes[size_t(r) - 1];
  std::vector<uint8_t> flat(size_t(displs.back() + sizes.back()) + 1);
  MPI_Allgatherv(bytes.data(), mine, MPI_BYTE, flat.data(), sizes.data(), displs.data(), MPI_BYTE, MPI_COMM_WORLD);
  for (int r = 0; r < p; ++r) {
    g.counts.emplace_back(all.begin() + r * p, all.begin() + (r + 1) * p);
    g.bytes.emplace_back(flat.begin() + displs[size_t(r)], flat.begin() + displs[size_t(r)] + sizes[size_t(r)]);
  }
  return g;
}

// One random exchange of rows of `row` elements of `dt` through `c`, the
// counts exchanged first, compared bitwise with the gathered reference.
void check_exchange(Communicator& c, DType dt, int64_t row, uint64_t seed) {
  const int p = c.size(), me = c.rank();
  const int silent = int(seed % uint64_t(p));
  SCOPED_TRACE(str_cat("all_to_all_v ", dtype_name(dt), " row=", row, " seed=", seed, " silent rank ", silent));
  std::vector<int64_t> send_counts(static_cast<size_t>(p));
  for (int d = 0; d < p; ++d) send_counts[size_t(d)] = rows_between(seed, me, d, silent);
  const std::vector<int64_t> recv_counts = c.exchange_counts(send_counts);
  int64_t send_rows = 0, recv_rows = 0;
  for (int q = 0; q < p; ++q) {
    EXPECT_EQ(recv_counts[size_t(q)], rows_between(seed, q, me, silent)) << "count from rank " << q;
    send_rows += send_counts[size_t(q)];
    recv_rows += recv_counts[size_t(q)];
  }
  Buf send(dt, send_rows * row), recv(dt, recv_rows * row);
  send.fill(seed, me);
  recv.poison();
  c.all_to_all_v(send.t().view({send_rows, row}), send_counts, recv.t().view({recv_rows, row}), recv_counts);

  const size_t esz = dtype_size(dt);
  const Gathered g = gather_sends(send_counts, std::vector<uint8_t>(send.bytes.begin(), send.bytes.end() - 1));
  std::vector<uint8_t> want;
  for (int q = 0; q < p; ++q) {
    const std::vector<int64_t> off = chunk_offsets(g.counts[size_t(q)], row);
    want.insert(want.end(), g.bytes[size_t(q)].begin() + off[size_t(me)] * int64_t(esz),
                g.bytes[size_t(q)].begin() + off[size_t(me) + 1] * int64_t(esz));
  }
  ASSERT_EQ(int64_t(want.size()), recv_rows * row * int64_t(esz));
  for (int64_t i = 0; i < recv_rows * row; ++i)
    if (std::memcmp(recv.bytes.data() + size_t(i) * esz, want.data() + size_t(i) * esz, esz) != 0) {
      ADD_FAILURE() << "element " << i << " of " << recv_rows * row << " differs from the gathered reference";
      return;
    }
}

TEST(MpiAllToAllV, RandomUnevenCountsMatchGatheredReferenceBitwise) {
  MpiCommunicator c(MPI_COMM_WORLD, "ep", kOpts);
  uint64_t seed = 900;
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t row : {1, 5, 64})
      for (int rep = 0; rep < 4; ++rep) check_exchange(c, dt, row, ++seed);
}

// The same through the link decorator (what a grid with comm.latency_us makes).
TEST(MpiAllToAllV, ThroughSimulatedLink) {
  SimulatedLink c(std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "ep", kOpts),
                  LinkModel{.latency_us = 100, .bandwidth_gbps = 1}, kOpts.timeout_s);
  check_exchange(c, DType::F32, 8, 950);
  check_exchange(c, DType::BF16, 3, 951);
}

// Counts travel as 64-bit values: ones above 2^32 survive the exchange.
TEST(MpiAllToAllV, ExchangeCountsKeepsAllSixtyFourBits) {
  MpiCommunicator c(MPI_COMM_WORLD, "ep", kOpts);
  const int p = c.size(), me = c.rank();
  auto count = [&](int src, int dst) { return (int64_t(src * p + dst + 1) << 33) + int64_t(rng_below(7, uint64_t(src), uint64_t(dst), 1000)); };
  std::vector<int64_t> send(static_cast<size_t>(p));
  for (int d = 0; d < p; ++d) send[size_t(d)] = count(me, d);
  const std::vector<int64_t> got = c.exchange_counts(send);
  ASSERT_EQ(int(got.size()), p);
  for (int q = 0; q < p; ++q) EXPECT_EQ(got[size_t(q)], count(q, me)) << "from rank " << q;
}

// Bad arguments fail on the calling rank alone, before anything is sent,
// with one line naming the group, the op and the rule.
TEST(MpiAllToAllV, BadArgumentsAreOneLineErrors) {
  MpiCommunicator c(MPI_COMM_WORLD, "ep", kOpts);
  const int p = c.size(), me = c.rank();
  std::vector<float> a(64, 1.0f), b(64, 2.0f);
  std::vector<int64_t> ones(static_cast<size_t>(p), 1);
  const Tensor send(a.data(), {int64_t(p), 2}, DType::F32), recv(b.data(), {int64_t(p), 2}, DType::F32);
  auto wrong_size = ones;
  wrong_size.push_back(1);
  expect_error([&] { c.all_to_all_v(send, wrong_size, recv, ones); }, ErrorKind::Comm,
               {"ep all_to_all_v (f32): send_counts has ", str_cat("expected one per rank of the group (", p, ")"),
                str_cat("rank ", me, " of ", p, " in group ep")});
  expect_error([&] { c.all_to_all_v(send, ones, recv, wrong_size); }, ErrorKind::Comm,
               {"recv_counts has ", str_cat(p + 1, " entries")});
  auto too_many = ones;
  too_many[0] = 2;
  expect_error([&] { c.all_to_all_v(send, too_many, recv, ones); }, ErrorKind::Comm,
               {str_cat("send_counts [2", p > 1 ? ", 1" : "", p > 2 ? ", 1" : ""), str_cat("sum to ", p + 1, " rows"),
                str_cat("has ", p)});
  auto negative = ones;
  negative[size_t(p - 1)] = -1;
  expect_error([&] { c.all_to_all_v(send, ones, recv, negative); }, ErrorKind::Comm,
               {str_cat("recv_counts[", p - 1, "] = -1 is negative")});
  const Tensor half(b.data(), {int64_t(p), 2}, DType::BF16);
  expect_error([&] { c.all_to_all_v(send, ones, half, ones); }, ErrorKind::Comm, {"have different dtypes"});
  const Tensor wide(b.data(), {int64_t(p), 3}, DType::F32);
  expect_error([&] { c.all_to_all_v(send, ones, wide, ones); }, ErrorKind::Comm,
               {"has 2 elements per row but recv", "has 3"});
  expect_error([&] { c.all_to_all_v(send, ones, Tensor(a.data() + 1, {int64_t(p), 2}, DType::F32), ones); },
               ErrorKind::Comm, {"overlap"});
  auto self = ones, self_recv = ones;
  self[size_t(me)] = 0;
  self[size_t((me + 1) % p)] += 1;  // same total, this rank's own rows differ
  if (p > 1)
    expect_error([&] { c.all_to_all_v(send, self, recv, self_recv); }, ErrorKind::Comm,
                 {str_cat("send_counts[", me, "] = 0 but recv_counts[", me, "] = 1")});
  expect_error([&] { c.exchange_counts(wrong_size); }, ErrorKind::Comm,
               {"ep exchange_counts: ", str_cat(p + 1, " counts"), "one per rank of the group"});
  expect_error([&] { c.exchange_counts(negative); }, ErrorKind::Comm, {"is -1 (negative)"});
  // More elements than MPI's int counts reach: refused before MPI sees it
  // (the tensors are never read: an address stands for each, the second
  // past the end of the first so that they do not overlap).
  const int64_t huge = int64_t(INT_MAX) + 1;
  std::vector<int64_t> big(static_cast<size_t>(p), 0);
  big[size_t(me)] = huge;
  const auto base = reinterpret_cast<uintptr_t>(a.data());
  const Tensor huge_send(reinterpret_cast<void*>(base), {huge}, DType::U16);
  const Tensor huge_recv(reinterpret_cast<void*>(base + uintptr_t(huge) * 2 + 64), {huge}, DType::U16);
  expect_error([&] { c.all_to_all_v(huge_send, big, huge_recv, big); }, ErrorKind::Comm,
               {"more than 2147483647 elements (MPI counts are int)"});
  // The channel still works after the refusals.
  check_exchange(c, DType::F32, 2, 990);
}

// A group of one copies its rows to itself; exchange_counts is the identity.
TEST(LocalAllToAllV, GroupOfOneCopies) {
  LocalCommunicator c("ep");
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, b(6, -1);
  c.all_to_all_v(Tensor(a.data(), {3, 2}, DType::F32), {3}, Tensor(b.data(), {3, 2}, DType::F32), {3});
  EXPECT_EQ(b, a);
  EXPECT_EQ(c.exchange_counts({5}), std::vector<int64_t>{5});
  expect_error([&] { c.all_to_all_v(Tensor(a.data(), {3, 2}, DType::F32), {3}, Tensor(b.data(), {2, 2}, DType::F32), {2}); },
               ErrorKind::Comm, {"send_counts[0] = 3 but recv_counts[0] = 2"});
}

// The trace ring records each all-to-all-v as a collective of the channel,
// with the bytes this rank sends, and the exchange of counts before it.
TEST(MpiAllToAllV, TraceRingRecordsThem) {
  const int p = world_size(), me = world_rank();
  CommTrace trace(me, p, "");
  CommOptions o = kOpts;
  o.trace = &trace;
  MpiCommunicator c(MPI_COMM_WORLD, "ep", o);
  check_exchange(c, DType::F32, 4, 777);
  const std::vector<CommOpRecord> recs = trace.records();
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].kind, CommOpKind::AllToAllV);  // exchange_counts: 8 bytes per peer
  EXPECT_EQ(recs[0].bytes, 8 * p);
  EXPECT_EQ(recs[1].kind, CommOpKind::AllToAllV);
  int64_t rows = 0;
  for (int d = 0; d < p; ++d) rows += rows_between(777, me, d, int(777 % uint64_t(p)));
  EXPECT_EQ(recs[1].bytes, rows * 4 * 4);
  for (const CommOpRecord& r : recs) {
    EXPECT_EQ(r.state, CommOpState::Done);
    EXPECT_EQ(r.peer, -1);
  }
  EXPECT_EQ(recs[0].seq, 1u);  // numbered as collectives: the same number on every rank
  EXPECT_EQ(recs[1].seq, 2u);
  EXPECT_NE(trace.to_json("test", 0).find("\"kind\": \"all_to_all_v\""), std::string::npos);
}

}  // namespace
}  // namespace xirang::test
