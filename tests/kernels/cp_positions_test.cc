// Tests for the context-parallel position overloads of add_positions
// (kernels/embedding.h) and rope_qkv (kernels/rope.h): a rank's rows through
// the overload equal, bit for bit, that rank's rows of the whole-sequence op
// (the same table rows, the same arithmetic per element), over the storage
// types, both splits and c = 2 and 4; and the overloads' shape errors.
#include <string>

#include "kernels/context_split.h"
#include "kernels/embedding.h"
#include "kernels/rope.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/storage_types.h"

namespace xirang::test {
namespace {

// Rank r's rows of (B, T, w): (B * T / c, w).
template <class S>
std::vector<S> rank_rows(const std::vector<S>& full, int64_t B, int64_t w, const ContextSplit& s, int r) {
  const int64_t Tl = s.local_rows();
  std::vector<S> v(size_t(B * Tl * w));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t)
      std::copy_n(full.begin() + (b * s.seq_len + s.position(r, t)) * w, w, v.begin() + (b * Tl + t) * w);
  return v;
}

std::vector<ContextSplit> splits() {
  return {ContextSplit::of(20, 2), ContextSplit::of(20, 2, false), ContextSplit::of(24, 4),
          ContextSplit::of(24, 4, false)};
}

template <class T>
class CpPositionsTest : public ::testing::Test {};
TYPED_TEST_SUITE(CpPositionsTest, StorageTypes, StorageTypeNames);

// Whole runs and a run that starts and ends inside sequences (row_offset 3).
TYPED_TEST(CpPositionsTest, AddPositionsEqualsWholeSequenceRows) {
  using E = TypeParam;
  using G = StatType<E>;  // dwpe: f32 beside 16-bit activations
  KernelContext ctx;
  const int64_t B = 2, C = 6;
  for (const ContextSplit& s : splits()) {
    SCOPED_TRACE(std::to_string(s.ranks) + (s.head_tail ? " head-tail" : " contiguous"));
    const int64_t T = s.seq_len, Tl = s.local_rows();
    auto wpe = cast_vec<E>(randn(size_t((T + 3) * C), 2701));
    auto x = cast_vec<E>(randn(size_t(B * T * C), 2702));
    auto whole = x;
    add_positions(ctx, view(whole, {B * T, C}), view(wpe, {T + 3, C}), T, 0);
    const auto dwpe0 = cast_vec<G>(randn(wpe.size(), 2703));
    auto dwhole = dwpe0;
    add_positions_backward(ctx, view(dwhole, {T + 3, C}), view(x, {B * T, C}), T, 0);
    for (int r = 0; r < s.ranks; ++r) {
      const auto want = rank_rows(whole, B, C, s, r);
      for (int64_t off : {int64_t(0), int64_t(3)}) {
        const int64_t n = B * Tl - 2 * off;
        auto mine = rank_rows(x, B, C, s, r);
        std::vector<E> run(mine.begin() + off * C, mine.begin() + (off + n) * C);
        add_positions(ctx, view(run, {n, C}), view(wpe, {T + 3, C}), s, r, off);
        EXPECT_EQ(bytes_of(run), bytes_of(std::vector<E>(want.begin() + off * C, want.begin() + (off + n) * C)))
            << "rank " << r << " offset " << off;
      }
      // Backward over the rank's rows: its positions' dwpe rows as in the
      // whole-sequence backward, every other row untouched.
      auto dx = rank_rows(x, B, C, s, r);
      auto dwpe = dwpe0;
      add_positions_backward(ctx, view(dwpe, {T + 3, C}), view(dx, {B * Tl, C}), s, r, 0);
      std::vector<bool> mine(size_t(T + 3), false);
      for (int64_t t = 0; t < Tl; ++t) mine[size_t(s.position(r, t))] = true;
      for (int64_t p = 0; p < T + 3; ++p)
        for (int64_t j = 0; j < C; ++j) {
          const size_t i = size_t(p * C + j);
          const auto& ref = mine[size_t(p)] ? dwhole : dwpe0;
          ASSERT_EQ(as_double(dwpe[i]), as_double(ref[i])) << "rank " << r << " position " << p;
        }
    }
  }
}

TYPED_TEST(CpPositionsTest, RopeQkvEqualsWholeSequenceRows) {
  using E = TypeParam;
  using Tab = StatType<E>;
  KernelContext ctx;
  const int64_t B = 2, H = 4, KV = 2, D = 8, W = (H + 2 * KV) * D;
  for (const ContextSplit& s : splits()) {
    SCOPED_TRACE(std::to_string(s.ranks) + (s.head_tail ? " head-tail" : " contiguous"));
    const int64_t T = s.seq_len, Tl = s.local_rows();
    std::vector<Tab> cos(size_t((T + 2) * D / 2)), sin(cos.size());
    rope_table(ctx, view(cos, {T + 2, D / 2}), view(sin, {T + 2, D / 2}), RopeConfig{});
    Tensor ct = view(cos, {T + 2, D / 2}), st = view(sin, {T + 2, D / 2});
    auto x = cast_vec<E>(randn(size_t(B * T * W), 2801));
    auto fwd = x, bwd = x;
    rope_qkv_forward(ctx, view(fwd, {B, T, W}), ct, st, int(H), int(KV), T, 0);
    rope_qkv_backward(ctx, view(bwd, {B, T, W}), ct, st, int(H), int(KV), T, 0);
    for (int r = 0; r < s.ranks; ++r) {
      auto f = rank_rows(x, B, W, s, r), b = f;
      rope_qkv_forward(ctx, view(f, {B, Tl, W}), ct, st, int(H), int(KV), s, r);
      rope_qkv_backward(ctx, view(b, {B * Tl, W}), ct, st, int(H), int(KV), s, r);
      EXPECT_EQ(bytes_of(f), bytes_of(rank_rows(fwd, B, W, s, r))) << "forward, rank " << r;
      EXPECT_EQ(bytes_of(b), bytes_of(rank_rows(bwd, B, W, s, r))) << "backward, rank " << r;
    }
  }
}

TEST(CpPositions, BadSplitsAreShapeErrors) {
  KernelContext ctx;
  const int64_t C = 4, H = 2, KV = 1, D = 4, W = (H + 2 * KV) * D;
  const ContextSplit s = ContextSplit::of(16, 2);
  auto x = randn(size_t(8 * C), 1), wpe = randn(size_t(16 * C), 2), short_wpe = randn(size_t(12 * C), 3);
  expect_error([&] { add_positions(ctx, view(x, {8, C}), view(wpe, {16, C}), s, 2, 0); }, ErrorKind::Shape,
               {"add_positions", "rank 2"});
  expect_error([&] { add_positions(ctx, view(x, {8, C}), view(short_wpe, {12, C}), s, 0, 0); }, ErrorKind::Shape,
               {"add_positions", "cannot cover 16"});
  expect_error([&] { add_positions_backward(ctx, view(wpe, {16, C}), view(x, {8, C}), ContextSplit::of(14, 2), 0, 0); },
               ErrorKind::Shape, {"add_positions_backward", "not a multiple"});
  auto qkv = randn(size_t(8 * W), 4), cos = randn(size_t(12 * D / 2), 5), sin = cos;
  auto cos16 = randn(size_t(16 * D / 2), 6), sin16 = cos16;
  expect_error(
      [&] {
        rope_qkv_forward(ctx, view(qkv, {8, W}), view(cos, {12, D / 2}), view(sin, {12, D / 2}), int(H), int(KV), s, 0);
      },
      ErrorKind::Shape, {"rope_qkv_forward", "outside the table"});
  auto odd = randn(size_t(7 * W), 7);
  expect_error(
      [&] {
        rope_qkv_backward(ctx, view(odd, {7, W}), view(cos16, {16, D / 2}), view(sin16, {16, D / 2}), int(H), int(KV),
                          s, 1);
      },
      ErrorKind::Shape, {"rope_qkv_backward", "whole sequences"});
}

}  // namespace
}  // namespace xirang::test
