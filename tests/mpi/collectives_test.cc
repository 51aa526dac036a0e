// Tests of MpiCommunicator's collectives against a serial reference that
// every rank computes locally from every rank's (regenerated) input, for
// every dtype, odd sizes and sizes the group size does not divide.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "comm/mpi_communicator.h"
#include "core/clock.h"
#include "tests/mpi/mpi_test_util.h"

namespace xirang::test {
namespace {

// Compares got[offset + k] with want(offset + k) for k in [0, n); reports the
// first mismatch and the count instead of one failure per element.
void expect_matches(const Buf& got, int64_t offset, int64_t n, const std::function<double(int64_t)>& want,
                    const std::function<double(int64_t)>& tol) {
  int64_t bad = 0, first = -1;
  for (int64_t k = 0; k < n; ++k) {
    int64_t i = offset + k;
    double w = want(i), g = got.get(k);
    if (!(std::fabs(g - w) <= tol(i))) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  if (bad > 0)
    ADD_FAILURE() << bad << " of " << n << " elements differ; first at global index " << first << ": got "
                  << got.get(first - offset) << ", want " << want(first) << " (tolerance " << tol(first) << ")";
}

int owner(int64_t n, int p, int64_t i) {
  for (int r = 0; r < p; ++r)
    if (i < split_range(n, p, r).second) return r;
  return p - 1;
}

double ref_sum(DType dt, uint64_t seed, int p, int64_t i) {
  double s = 0;
  for (int r = 0; r < p; ++r) s += input_value(dt, seed, r, i);
  return s;
}
double ref_sum_abs(DType dt, uint64_t seed, int p, int64_t i) {
  double s = 0;
  for (int r = 0; r < p; ++r) s += std::fabs(input_value(dt, seed, r, i));
  return s;
}
double ref_max(DType dt, uint64_t seed, int p, int64_t i) {
  double m = input_value(dt, seed, 0, i);
  for (int r = 1; r < p; ++r) m = std::max(m, input_value(dt, seed, r, i));
  return m;
}

std::function<double(int64_t)> want_of(DType dt, ReduceOp op, uint64_t seed, int p) {
  if (op == ReduceOp::Max) return [=](int64_t i) { return ref_max(dt, seed, p, i); };
  return [=](int64_t i) { return ref_sum(dt, seed, p, i); };
}
// Max picks one of the inputs, so it is exact in every dtype.
std::function<double(int64_t)> tol_of(DType dt, ReduceOp op, uint64_t seed, int p) {
  if (op == ReduceOp::Max) return [](int64_t) { return 0.0; };
  return [=](int64_t i) { return sum_tolerance(dt, p, ref_sum_abs(dt, seed, p, i)); };
}

const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

void check_all_reduce(Communicator& c, DType dt, int64_t n, ReduceOp op, uint64_t seed) {
  SCOPED_TRACE(str_cat("all_reduce ", op_name(op), " ", dtype_name(dt), " n=", n));
  Buf b(dt, n);
  b.fill(seed, c.rank());
  c.all_reduce(b.t(), op);
  expect_matches(b, 0, n, want_of(dt, op, seed, c.size()), tol_of(dt, op, seed, c.size()));
}

TEST(MpiCollectives, AllReduceSumAndMaxEveryDtype) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  uint64_t seed = 100;
  for (DType dt : reduce_dtypes())
    for (int64_t n : {1, 7, 1003})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) check_all_reduce(c, dt, n, op, seed++);
  // The token-storage types reduce too (Max of token ids, say).
  check_all_reduce(c, DType::U16, 257, ReduceOp::Max, seed++);
  check_all_reduce(c, DType::U32, 257, ReduceOp::Sum, seed++);
}

TEST(MpiCollectives, AllReduceLargeF32) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  check_all_reduce(c, DType::F32, 1000003, ReduceOp::Sum, 7);
}

void check_reduce_scatter(Communicator& c, DType dt, int64_t n, ReduceOp op, uint64_t seed, bool in_place) {
  SCOPED_TRACE(str_cat("reduce_scatter ", op_name(op), " ", dtype_name(dt), " n=", n, in_place ? " in place" : ""));
  auto [b, e] = split_range(n, c.size(), c.rank());
  Buf in(dt, n), out(dt, e - b);
  in.fill(seed, c.rank());
  out.poison();
  if (in_place) {
    c.reduce_scatter(in.t(), in.range(b, e), op);
    for (int64_t k = 0; k < e - b; ++k) out.set(k, in.get(b + k));
  } else {
    c.reduce_scatter(in.t(), out.t(), op);
  }
  expect_matches(out, b, e - b, want_of(dt, op, seed, c.size()), tol_of(dt, op, seed, c.size()));
}

TEST(MpiCollectives, ReduceScatterUnevenSizesEveryDtype) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  uint64_t seed = 200;
  // n = 1 leaves most ranks an empty chunk; 1001 and 7 divide by none of 2, 3, 4.
  for (DType dt : reduce_dtypes())
    for (int64_t n : {1, 7, 1001})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max})
        for (bool in_place : {false, true}) check_reduce_scatter(c, dt, n, op, seed++, in_place);
}

void check_all_gather(Communicator& c, DType dt, int64_t n, uint64_t seed, bool in_place) {
  SCOPED_TRACE(str_cat("all_gather ", dtype_name(dt), " n=", n, in_place ? " in place" : ""));
  int p = c.size();
  auto [b, e] = split_range(n, p, c.rank());
  Buf out(dt, n), in(dt, e - b);
  out.poison();
  if (in_place) {
    out.fill(seed, c.rank(), b, e);
    c.all_gather(out.range(b, e), out.t());
  } else {
    for (int64_t k = 0; k < e - b; ++k) in.set(k, input_value(dt, seed, c.rank(), b + k));
    c.all_gather(in.t(), out.t());
  }
  expect_matches(
      out, 0, n, [=](int64_t i) { return input_value(dt, seed, owner(n, p, i), i); }, [](int64_t) { return 0.0; });
}

TEST(MpiCollectives, AllGatherOutOfPlaceAndInPlaceEveryDtype) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  uint64_t seed = 300;
  for (DType dt : reduce_dtypes())
    for (int64_t n : {1, 5, 7, 1001, 100003})
      for (bool in_place : {false, true}) check_all_gather(c, dt, n, seed++, in_place);
}

TEST(MpiCollectives, BroadcastFromEveryRootEveryDtype) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  uint64_t seed = 400;
  for (DType dt : reduce_dtypes())
    for (int64_t n : {1, 1003})
      for (int root = 0; root < c.size(); ++root, ++seed) {
        SCOPED_TRACE(str_cat("broadcast ", dtype_name(dt), " n=", n, " root=", root));
        Buf b(dt, n);
        b.fill(seed, c.rank());
        c.broadcast(b.t(), root);
        expect_matches(
            b, 0, n, [=](int64_t i) { return input_value(dt, seed, root, i); }, [](int64_t) { return 0.0; });
      }
}

// Several operations of different kinds in flight at once; completion is
// observed through test(), then the handles are waited in reverse order.
TEST(MpiCollectives, SeveralInFlightWaitedInReverseOrder) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  int p = c.size(), r = c.rank();
  const int64_t n_rs = 1003, n_ag = 999;
  auto [rb, re] = split_range(n_rs, p, r);
  auto [gb, ge] = split_range(n_ag, p, r);
  Buf sum(DType::F32, 1001), mx(DType::F64, 77), rs_in(DType::BF16, n_rs), rs_out(DType::BF16, re - rb);
  Buf ag_in(DType::I32, ge - gb), ag_out(DType::I32, n_ag), bc(DType::F16, 501);
  sum.fill(1, r);
  mx.fill(2, r);
  rs_in.fill(3, r);
  for (int64_t k = 0; k < ge - gb; ++k) ag_in.set(k, input_value(DType::I32, 4, r, gb + k));
  ag_out.poison();
  bc.fill(5, r);
  std::vector<Buf> small(20, Buf(DType::F64, 3));
  for (size_t k = 0; k < small.size(); ++k) small[k].fill(10 + k, r);

  Stopwatch wall;  // from before the first submission: no operation can take longer
  std::vector<WorkPtr> works;
  works.push_back(c.all_reduce_async(sum.t(), ReduceOp::Sum));
  works.push_back(c.all_reduce_async(mx.t(), ReduceOp::Max));
  works.push_back(c.reduce_scatter_async(rs_in.t(), rs_out.t(), ReduceOp::Sum));
  works.push_back(c.all_gather_async(ag_in.t(), ag_out.t()));
  works.push_back(c.broadcast_async(bc.t(), p - 1));
  for (auto& s : small) works.push_back(c.all_reduce_async(s.t(), ReduceOp::Sum));

  Stopwatch sw;
  while (!std::all_of(works.begin(), works.end(), [](const WorkPtr& w) { return w->test(); }) && sw.seconds() < 30)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (auto& w : works) EXPECT_TRUE(w->test());
  for (auto it = works.rbegin(); it != works.rend(); ++it) {
    (*it)->wait();
    EXPECT_GT((*it)->duration_ms(), 0.0);
    EXPECT_LE((*it)->duration_ms(), wall.ms());
  }
  expect_matches(sum, 0, sum.n, want_of(DType::F32, ReduceOp::Sum, 1, p), tol_of(DType::F32, ReduceOp::Sum, 1, p));
  expect_matches(mx, 0, mx.n, want_of(DType::F64, ReduceOp::Max, 2, p), tol_of(DType::F64, ReduceOp::Max, 2, p));
  expect_matches(rs_out, rb, re - rb, want_of(DType::BF16, ReduceOp::Sum, 3, p),
                 tol_of(DType::BF16, ReduceOp::Sum, 3, p));
  expect_matches(
      ag_out, 0, n_ag, [=](int64_t i) { return input_value(DType::I32, 4, owner(n_ag, p, i), i); },
      [](int64_t) { return 0.0; });
  expect_matches(
      bc, 0, bc.n, [=](int64_t i) { return input_value(DType::F16, 5, p - 1, i); }, [](int64_t) { return 0.0; });
  for (size_t k = 0; k < small.size(); ++k)
    expect_matches(small[k], 0, 3, want_of(DType::F64, ReduceOp::Sum, 10 + k, p),
                   tol_of(DType::F64, ReduceOp::Sum, 10 + k, p));
}

// Duration runs from submission to completion: a rank that submits at once
// waits in its all-reduce for a peer that arrives 100 ms later, and its
// duration shows that wait (the bound allows 50 ms of skew between the
// ranks leaving the barrier on a loaded machine); no duration exceeds the
// caller's own wall time from submission to the end of wait().
TEST(MpiCollectives, DurationCountsTheWaitForALatePeer) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
  Buf b(DType::F32, 1000);
  b.fill(6, c.rank());
  const int late = c.size() - 1;
  c.barrier();
  if (c.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Stopwatch wall;
  WorkPtr w = c.all_reduce_async(b.t(), ReduceOp::Sum);
  w->wait();
  const double wall_ms = wall.ms();
  EXPECT_GT(w->duration_ms(), 0.0);
  EXPECT_LE(w->duration_ms(), wall_ms);
  if (c.rank() != late) {
    EXPECT_GE(w->duration_ms(), 50.0) << "the wait for the late rank is not in the duration";
  }
  expect_matches(b, 0, b.n, want_of(DType::F32, ReduceOp::Sum, 6, c.size()), tol_of(DType::F32, ReduceOp::Sum, 6, c.size()));
}

TEST(MpiCollectives, BarrierAndScalarSum) {
  MpiCommunicator c(MPI_COMM_WORLD, "world", kOpts);
  for (int k = 0; k < 5; ++k) c.barrier();
  EXPECT_EQ(c.all_reduce_sum(c.rank() + 1.0), c.size() * (c.size() + 1) / 2.0);
  EXPECT_EQ(c.name(), "world");
  EXPECT_EQ(c.rank(), world_rank());
  EXPECT_EQ(c.size(), world_size());
}

// A group of one still goes through MPI; every collective is then the identity.
TEST(MpiCollectives, GroupOfOne) {
  MpiCommunicator c(MPI_COMM_SELF, "self", kOpts);
  ASSERT_EQ(c.size(), 1);
  ASSERT_EQ(c.rank(), 0);
  int r = world_rank();
  Buf a(DType::BF16, 9), in(DType::F32, 9), out(DType::F32, 9), bc(DType::F64, 4), got(DType::I32, 5), sent(DType::I32, 5);
  a.fill(1, r);
  in.fill(2, r);
  bc.fill(3, r);
  sent.fill(4, r);
  c.all_reduce(a.t(), ReduceOp::Sum);
  expect_matches(a, 0, 9, [=](int64_t i) { return input_value(DType::BF16, 1, r, i); }, [](int64_t) { return 0.0; });
  c.reduce_scatter(in.t(), out.t(), ReduceOp::Max);
  expect_matches(out, 0, 9, [=](int64_t i) { return input_value(DType::F32, 2, r, i); }, [](int64_t) { return 0.0; });
  out.poison();
  c.all_gather(in.t(), out.t());
  expect_matches(out, 0, 9, [=](int64_t i) { return input_value(DType::F32, 2, r, i); }, [](int64_t) { return 0.0; });
  c.broadcast(bc.t(), 0);
  expect_matches(bc, 0, 4, [=](int64_t i) { return input_value(DType::F64, 3, r, i); }, [](int64_t) { return 0.0; });
  WorkPtr rv = c.recv_async(got.t(), 0, 5);
  c.send(sent.t(), 0, 5);
  rv->wait();
  expect_matches(got, 0, 5, [=](int64_t i) { return input_value(DType::I32, 4, r, i); }, [](int64_t) { return 0.0; });
}

}  // namespace
}  // namespace xirang::test
