// Generation with a key/value cache (models/decode.h) against the training
// forward: for GPT-2 and LLaMA (untied and tied head, grouped-query
// attention with n_kv_head < n_head, Llama 3.1 rope scaling), the logits of
// a prefill of the whole sequence, of decoding it one token at a time, and
// of a prefix followed by uneven chunks equal the training forward's logits
// of the same rows. Tolerance, relative to the largest |logit| (at least 1):
// f64 1e-12 (only the order of sums inside products differs), f32 1e-5
// (matrix products of 1 row and of T rows may sum in another order). Also:
// the same bits for 1 and 2 OpenMP and BLAS threads (tokens and logits),
// greedy decoding repeats, the sampler's rules, and the bad input a
// decoder refuses.
#include <cblas.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/rng.h"
#include "models/decode.h"
#include "models/llama/llama.h"
#include "models/qwen3/qwen3.h"
#include "tests/models/model_fixture.h"

namespace xirang {
namespace {

ModelDims gpt2_dims(int d_model = 32, int vocab = 50) {
  return ModelDims{.arch = "gpt2", .n_layer = 2, .n_head = 4, .d_model = d_model, .max_seq_len = 16,
                   .vocab_size = vocab, .vocab_multiple = 16};
}

// Qwen3: heads 10 wide where d_model / n_head is 8, and a q/k norm.
ModelDims llama_dims(bool tied, bool qwen3 = false) {
  ModelDims d{.arch = qwen3 ? "qwen3" : "llama", .n_layer = 2, .n_head = 4, .n_kv_head = 2,
              .head_dim = qwen3 ? 10 : 0, .d_model = 32, .ffn_hidden = 40, .max_seq_len = 12, .vocab_size = 37,
              .vocab_multiple = 16};
  d.rope = RopeConfig{10000.0, RopeScaling::llama3(4, 1, 2, 8)};
  d.tie_embeddings = tied;
  return d;
}

std::vector<int32_t> random_tokens(int64_t n, int vocab, uint64_t seed) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(int32_t(rng_below(seed, 3, uint64_t(i), uint64_t(vocab))));
  return t;
}

std::vector<double> as_doubles(const Tensor& t) {
  std::vector<double> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = t.dtype() == DType::F64 ? t.data<double>()[i] : double(t.data<float>()[i]);
  return v;
}

// The training forward's logits (T, Vp) of one sequence.
template <class Model>
std::vector<double> training_logits(ChunkInArenas<Model>& m, std::vector<int32_t>& tokens) {
  const int64_t T = int64_t(tokens.size());
  std::vector<int32_t> targets(tokens.size(), 0);
  m.model.forward(KernelContext{}, 0, Tensor(tokens.data(), {1, T}, DType::I32),
                  Tensor(targets.data(), {1, T}, DType::I32), 0.0);
  m.model.take_loss(KernelContext{});
  return as_doubles(m.model.logits(0));
}

// Runs the sequence through a fresh decoder in chunks; the logits of every row (T, Vp).
std::vector<double> decoded_logits(Decoder& dec, const std::vector<int32_t>& tokens,
                                   const std::vector<int64_t>& chunks) {
  dec.reset();
  std::vector<double> all;
  int64_t at = 0;
  for (int64_t n : chunks) {
    const Tensor logits = dec.forward(KernelContext{}, tokens.data() + at, n);
    EXPECT_EQ(logits.size(0), n) << "the decoder was made to return every row";
    const std::vector<double> v = as_doubles(logits);
    all.insert(all.end(), v.begin(), v.end());
    at += n;
  }
  EXPECT_EQ(dec.position(), at);
  return all;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& ref, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 1, worst = 0;
  size_t at = 0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::isnan(got[i]) ? INFINITY : std::fabs(got[i] - ref[i]);
    if (e > worst) worst = e, at = i;
  }
  EXPECT_LE(worst, rel * scale) << what << ": worst element " << at << " got " << got[at] << ", training forward "
                                << ref[at] << " (scale " << scale << ")";
}

template <class Model>
void check_against_training(const ModelDims& dims, DType dt, double rel, const std::string& name) {
  const int64_t T = dims.max_seq_len;  // the whole context, up to the last position
  ChunkInArenas<Model> m(dims, ChunkPlacement::whole(dims.n_layer), dt, ChunkBatch{1, int(T), 1});
  randomize_parameters(m.model, 21);
  std::vector<int32_t> tokens = random_tokens(T, dims.vocab_size, 5);
  const std::vector<double> ref = training_logits(m, tokens);
  std::unique_ptr<Decoder> dec = make_decoder(m.model, Device::CPU, int(T));
  std::vector<int64_t> ones(size_t(T), 1), mixed{5, 1, 3};
  mixed.push_back(T - 9);
  expect_close(decoded_logits(*dec, tokens, {T}), ref, rel, name + " prefill");
  expect_close(decoded_logits(*dec, tokens, ones), ref, rel, name + " token by token");
  expect_close(decoded_logits(*dec, tokens, mixed), ref, rel, name + " prefix and chunks");
}

TEST(Decode, Gpt2MatchesTrainingForward) {
  check_against_training<GPT2>(gpt2_dims(), DType::F64, 1e-12, "gpt2 f64");
  check_against_training<GPT2>(gpt2_dims(), DType::F32, 1e-5, "gpt2 f32");
}

TEST(Decode, LlamaUntiedMatchesTrainingForward) {
  check_against_training<Llama>(llama_dims(false), DType::F64, 1e-12, "llama untied f64");
  check_against_training<Llama>(llama_dims(false), DType::F32, 1e-5, "llama untied f32");
}

TEST(Decode, LlamaTiedMatchesTrainingForward) {
  check_against_training<Llama>(llama_dims(true), DType::F64, 1e-12, "llama tied f64");
  check_against_training<Llama>(llama_dims(true), DType::F32, 1e-5, "llama tied f32");
}

TEST(Decode, Qwen3MatchesTrainingForward) {
  for (bool tied : {false, true}) {
    check_against_training<Qwen3>(llama_dims(tied, true), DType::F64, 1e-12, "qwen3 f64");
    check_against_training<Qwen3>(llama_dims(tied, true), DType::F32, 1e-5, "qwen3 f32");
  }
}

// Greedy generation of `n` tokens after a prompt: the tokens, and every step's logits as bytes.
std::vector<int32_t> greedy(Decoder& dec, std::vector<int32_t> prompt, int n, std::vector<float>* logits_out) {
  dec.reset();
  const int vocab = dec.dims().vocab_size;
  Tensor logits = dec.forward(KernelContext{}, prompt.data(), int64_t(prompt.size()));
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const std::vector<float> row = logits_to_host(KernelContext{}, logits, logits.size(0) - 1, vocab);
    if (logits_out) logits_out->insert(logits_out->end(), row.begin(), row.end());
    const int32_t next = sample_token(row, SamplingOptions{.temperature = 0}, uint64_t(i));
    out.push_back(next);
    logits = dec.forward(KernelContext{}, &next, 1);
  }
  return out;
}

// Large enough that the head's product (1 x 64 x 8192) and the prefill's
// products run on several BLAS threads.
template <class Model>
void check_thread_counts(const ModelDims& dims) {
  ChunkInArenas<Model> m(dims, ChunkPlacement::whole(dims.n_layer), DType::F32, ChunkBatch{1, 1, 1});
  randomize_parameters(m.model, 4);
  std::unique_ptr<Decoder> dec = make_decoder(m.model, Device::CPU);
  const std::vector<int32_t> prompt = random_tokens(24, dims.vocab_size, 8);
  const int omp_before = omp_get_max_threads(), blas_before = openblas_get_num_threads();
  std::map<int, std::vector<int32_t>> tokens;
  std::map<int, std::vector<float>> logits;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    tokens[threads] = greedy(*dec, prompt, 30, &logits[threads]);
  }
  omp_set_num_threads(omp_before);
  openblas_set_num_threads(blas_before);
  for (int threads : {2, 3}) {
    EXPECT_EQ(tokens[threads], tokens[1]) << threads << " threads";
    ASSERT_EQ(logits[threads].size(), logits[1].size());
    EXPECT_EQ(0, std::memcmp(logits[threads].data(), logits[1].data(), logits[1].size() * sizeof(float)))
        << "the logits of " << threads << " threads differ from one thread's";
  }
  // Greedy decoding repeats, and is not stuck on one token.
  EXPECT_EQ(greedy(*dec, prompt, 30, nullptr), tokens[1]);
  std::map<int32_t, int> seen;
  for (int32_t t : tokens[1]) seen[t]++;
  EXPECT_GT(seen.size(), 1u);
}

TEST(Decode, SameTokensAndLogitsForAnyThreadCount) {
  check_thread_counts<GPT2>(ModelDims{.arch = "gpt2", .n_layer = 2, .n_head = 4, .d_model = 64, .max_seq_len = 64,
                                      .vocab_size = 8192, .vocab_multiple = 128});
}

TEST(Decode, Qwen3SameTokensAndLogitsForAnyThreadCount) {
  check_thread_counts<Qwen3>(ModelDims{.arch = "qwen3", .n_layer = 2, .n_head = 4, .n_kv_head = 2, .head_dim = 32,
                                       .d_model = 64, .ffn_hidden = 160, .max_seq_len = 64, .vocab_size = 8192,
                                       .vocab_multiple = 128, .norm_eps = 1e-6});
}

TEST(Decode, SamplingRules) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 0.0f};
  // Greedy: the largest, the lower id on a tie; top-k 1 is greedy at any temperature.
  EXPECT_EQ(sample_token(logits, {.temperature = 0}, 0), 1);
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(sample_token(logits, {.temperature = 5, .top_k = 1, .seed = 3}, i), 1);
  // The same (options, draw) gives the same token; top-k restricts the draws.
  std::map<int32_t, int> counts;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    const int32_t t = sample_token(logits, {.temperature = 1, .top_k = 3, .seed = 9}, uint64_t(i));
    EXPECT_EQ(t, sample_token(logits, {.temperature = 1, .top_k = 3, .seed = 9}, uint64_t(i)));
    counts[t]++;
  }
  ASSERT_EQ(counts.size(), 3u);  // ids 1, 3 (logit 2) and 4 (logit 1)
  const double z = 2 * std::exp(2.0) + std::exp(1.0);
  EXPECT_NEAR(counts[1] / double(draws), std::exp(2.0) / z, 0.015);
  EXPECT_NEAR(counts[3] / double(draws), std::exp(2.0) / z, 0.015);
  EXPECT_NEAR(counts[4] / double(draws), std::exp(1.0) / z, 0.015);
  // Temperature 2 flattens: p ~ exp(logit / 2) over all six.
  counts.clear();
  double z2 = 0;
  for (float l : logits) z2 += std::exp(l / 2.0);
  for (int i = 0; i < draws; ++i) counts[sample_token(logits, {.temperature = 2, .seed = 1}, uint64_t(i))]++;
  for (int32_t t = 0; t < 6; ++t)
    EXPECT_NEAR(counts[t] / double(draws), std::exp(logits[size_t(t)] / 2.0) / z2, 0.015) << "token " << t;
  // Another seed draws another sequence.
  int differ = 0;
  for (uint64_t i = 0; i < 50; ++i)
    differ += sample_token(logits, {.temperature = 1, .seed = 1}, i) !=
              sample_token(logits, {.temperature = 1, .seed = 2}, i);
  EXPECT_GT(differ, 5);
  // Bad options.
  EXPECT_THROW(sample_token(logits, {.temperature = -0.5}, 0), Error);
  EXPECT_THROW(sample_token(logits, {.temperature = NAN}, 0), Error);
  EXPECT_THROW(sample_token(logits, {.temperature = 1, .top_k = -2}, 0), Error);
}

TEST(Decode, BadInput) {
  const ModelDims dims = gpt2_dims();
  ChunkInArenas<GPT2> m(dims, ChunkPlacement::whole(dims.n_layer), DType::F32, ChunkBatch{1, 4, 1});
  randomize_parameters(m.model, 2);
  std::unique_ptr<Decoder> dec = make_decoder(m.model, Device::CPU);
  std::vector<int32_t> tokens = random_tokens(20, dims.vocab_size, 1);
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(nothing thrown)";
  };
  EXPECT_NE(message([&] { dec->forward(KernelContext{}, tokens.data(), 17); }).find("model sees at most 16"),
            std::string::npos);
  dec->forward(KernelContext{}, tokens.data(), 16);
  EXPECT_NE(message([&] { dec->forward(KernelContext{}, tokens.data(), 1); }).find("would need 17 positions"),
            std::string::npos);
  dec->reset();
  tokens[2] = dims.vocab_size;
  EXPECT_NE(message([&] { dec->forward(KernelContext{}, tokens.data(), 3); }).find("outside the vocabulary"),
            std::string::npos);
  // A pipeline chunk, a tensor-parallel shard.
  GPT2 part(dims, ChunkPlacement::of_chunk(dims.n_layer, 2, 0), DType::F32, ChunkBatch{1, 4, 1});
  EXPECT_NE(message([&] { make_decoder(part, Device::CPU); }).find("whole model in one chunk"), std::string::npos);
  GPT2 shard(dims, ChunkPlacement::whole(dims.n_layer), DType::F32, ChunkBatch{1, 4, 1},
             TensorParallel{.size = 2, .rank = 0});
  EXPECT_NE(message([&] { make_decoder(shard, Device::CPU); }).find("tensor-parallel shard"), std::string::npos);
}

}  // namespace
}  // namespace xirang
