// The loader under context parallelism: each cp rank gets only its rows of
// every sample (kernels/context_split.h), the cp ranks of a dp rank read the
// same samples, and put back at their positions the ranks' rows are the
// one-rank batch exactly; a rank never reads tokens it does not hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/context_split.h"
#include "runtime/data/dataset.h"
#include "runtime/data/loader.h"
#include "runtime/data/sampler.h"
#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 50000;
constexpr int kT = 48;  // 2 x cp chunks for cp = 2, 4 (and 3)
constexpr int64_t kTokens = 40 * kT + 3;

TokenDataset make_dataset(const std::string& dir, int64_t shard_tokens) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int64_t> id(1, kVocab - 1);
  DatasetWriter w(dir, "bytes", kVocab, -1, shard_tokens);
  std::vector<int32_t> doc(static_cast<size_t>(kTokens));
  for (auto& t : doc) t = int32_t(id(rng));
  w.add_document(doc.data(), doc.size());
  w.finish();
  return TokenDataset::open(dir);
}

// A cp rank's rows as the trainer hands them to the loader (Trainer::sample_rows).
SampleRows rows_of(const ContextSplit& split, int rank) {
  SampleRows r;
  if (split.ranks == 1) return r;
  r.length = split.chunk();
  for (int part = 0; part < 2; ++part) r.starts.push_back(split.chunk_of(rank, part) * split.chunk());
  return r;
}

LoaderSpec spec_for(int B, int64_t GB, int dp, int dp_rank, const SampleRows& rows) {
  LoaderSpec s;
  s.seq_len = kT;
  s.seed = 99;
  s.micro_batch = B;
  s.global_batch = GB;
  s.dp = dp;
  s.dp_rank = dp_rank;
  s.microbatches = int(GB / (int64_t(dp) * B));
  s.rows = rows;
  return s;
}

LoaderOptions prefetching() {
  LoaderOptions o;
  o.threads = 2;
  return o;
}

// Every microbatch of 3 steps, dp 2: the cp ranks' rows, each put at
// position(rank, t), rebuild the cp = 1 loader's (B, T) tokens and targets.
TEST(LoaderCp, RanksRowsAtTheirPositionsAreTheWholeBatch) {
  const std::string dir = testing_util::fresh_test_dir("cp_data");
  const TokenDataset data = make_dataset(dir, 300);
  const int B = 2, dp = 2;
  const int64_t GB = 8;
  for (const int cp : {2, 3, 4})
    for (const bool head_tail : {true, false})
      for (int d = 0; d < dp; ++d) {
        SCOPED_TRACE(str_cat("cp ", cp, head_tail ? " head_tail" : " contiguous", " dp rank ", d));
        const ContextSplit split = ContextSplit::of(kT, cp, head_tail);
        PrefetchLoader whole(data, spec_for(B, GB, dp, d, {}), prefetching());
        std::vector<std::unique_ptr<PrefetchLoader>> ranks;
        for (int r = 0; r < cp; ++r)
          ranks.push_back(std::make_unique<PrefetchLoader>(data, spec_for(B, GB, dp, d, rows_of(split, r)), prefetching()));
        const int64_t local = split.local_rows();
        ASSERT_EQ(local * cp, kT);
        ASSERT_EQ(ranks[0]->rows(), local);
        for (int64_t step = 0; step < 3; ++step)
          for (int mb = 0; mb < int(GB / (dp * B)); ++mb) {
            std::vector<int32_t> want_tk(size_t(B * kT)), want_tg(size_t(B * kT));
            whole.next(step, mb, want_tk.data(), want_tg.data());
            std::vector<int32_t> got_tk(size_t(B * kT), -1), got_tg(size_t(B * kT), -1);
            for (int r = 0; r < cp; ++r) {
              // One extra row of guard values: a rank writes exactly B x T/cp.
              std::vector<int32_t> tk(size_t(B * local + 1), -7), tg(size_t(B * local + 1), -7);
              ranks[size_t(r)]->next(step, mb, tk.data(), tg.data());
              EXPECT_EQ(tk.back(), -7);
              EXPECT_EQ(tg.back(), -7);
              for (int b = 0; b < B; ++b)
                for (int64_t t = 0; t < local; ++t) {
                  const size_t at = size_t(b * kT + split.position(r, t));
                  EXPECT_EQ(got_tk[at], -1) << "two ranks hold position " << split.position(r, t);
                  got_tk[at] = tk[size_t(b * local + t)];
                  got_tg[at] = tg[size_t(b * local + t)];
                }
            }
            ASSERT_EQ(got_tk, want_tk) << "step " << step << " microbatch " << mb;
            ASSERT_EQ(got_tg, want_tg) << "step " << step << " microbatch " << mb;
          }
      }
}

// The tensor form checks the (B, T/cp) shape, not (B, T).
TEST(LoaderCp, TensorsAreTheRanksRows) {
  const std::string dir = testing_util::fresh_test_dir("cp_tensors");
  const TokenDataset data = make_dataset(dir, 300);
  const ContextSplit split = ContextSplit::of(kT, 2, true);
  PrefetchLoader l(data, spec_for(2, 4, 1, 0, rows_of(split, 1)), prefetching());
  std::vector<int32_t> tk(size_t(2 * kT)), tg(size_t(2 * kT));
  Tensor full(tk.data(), {2, kT}, DType::I32);
  EXPECT_THROW(l.next(0, 0, full, Tensor(), nullptr), Error);
  Tensor half(tk.data(), {2, kT / 2}, DType::I32), half_tg(tg.data(), {2, kT / 2}, DType::I32);
  EXPECT_NO_THROW(l.next(0, 0, half, half_tg, nullptr));
  // Rows outside a sample are refused at construction, with the rule.
  SampleRows bad{.length = kT / 2, .starts = {kT / 2 + 1}};
  try {
    PrefetchLoader b(data, spec_for(2, 4, 1, 0, bad), prefetching());
    ADD_FAILURE() << "rows past the sample's end were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("rows [25, 49) are not within a sample of seq_len 48"), std::string::npos)
        << e.what();
  }
}

// Overwrites the stored token at global position `pos` with an id outside
// the vocabulary, found by the unique run of tokens around it in the one
// shard file (ids stored as 16-bit little-endian: the vocabulary fits).
void corrupt_token(const std::string& dir, const TokenDataset& data, int64_t pos) {
  std::vector<int32_t> around(9);
  data.read(pos - 4, 9, around.data());
  std::vector<char> pattern;
  for (int32_t t : around) {
    pattern.push_back(char(t & 0xff));
    pattern.push_back(char((t >> 8) & 0xff));
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename() == "index.json") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto it = std::search(bytes.begin(), bytes.end(), pattern.begin(), pattern.end());
    if (it == bytes.end()) continue;
    f.clear();
    f.seekp(std::streamoff(it - bytes.begin()) + 8);
    const char bad[2] = {char(0xff), char(0xff)};
    f.write(bad, 2);
    return;
  }
  FAIL() << "token run around position " << pos << " not found in " << dir;
}

// A token only cp rank 1 holds (sample 0, position 20: chunk 1 of 4, of 12
// tokens) is unreadable: rank 0 (chunks 0 and 3) still reads its rows, so
// it never touched it; rank 1 and the whole sequence fail on it.
TEST(LoaderCp, ARankReadsOnlyItsRows) {
  const std::string dir = testing_util::fresh_test_dir("cp_reads");
  {
    const TokenDataset data = make_dataset(dir, 1 << 20);
    corrupt_token(dir, data, 20);
  }
  const TokenDataset data = TokenDataset::open(dir);
  const ContextSplit split = ContextSplit::of(kT, 2, true);
  SequenceSampler sampler(data, kT, 0, /*shuffle=*/false);  // sample 0 starts at token 0
  std::vector<int32_t> tk(kT), tg(kT);
  EXPECT_NO_THROW(sampler.fill(0, rows_of(split, 0), tk.data(), tg.data()));
  EXPECT_THROW(sampler.fill(0, rows_of(split, 1), tk.data(), tg.data()), Error);
  EXPECT_THROW(sampler.fill(0, SampleRows{}, tk.data(), tg.data()), Error);
  // Rank 1's rows of sample 1 (tokens 48 on) hold nothing corrupt.
  EXPECT_NO_THROW(sampler.fill(1, rows_of(split, 1), tk.data(), tg.data()));
}

}  // namespace
}  // namespace xirang
