// LLaMA and Qwen3 (LLaMA with per-head q/k RMSNorm and heads of their own
// width): a float64 finite-difference check of the hand-written backward
// pass for every parameter tensor (tied and untied head, grouped-query
// attention, rotary embeddings with Llama 3.1 scaling, the q/k norm
// weights), initialisation, Meta's MLP width rule, the forward against a
// direct transcription of transformers' Llama and Qwen3, and the Llama 3 8B
// shape.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <type_traits>
#include <string>
#include <vector>

#include "core/rng.h"
#include "models/llama/llama.h"
#include "models/qwen3/qwen3.h"
#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"
#include "tests/kernels/gradcheck.h"
#include "tests/models/model_fixture.h"

namespace xirang {
namespace {

// Qwen3: heads 6 wide where d_model / n_head is 4.
ModelDims tiny_dims(bool tied, bool qwen3 = false) {
  ModelDims d{.arch = qwen3 ? "qwen3" : "llama", .n_layer = 2, .n_head = 4, .n_kv_head = 2, .head_dim = qwen3 ? 6 : 0,
              .d_model = 16, .ffn_hidden = 24, .max_seq_len = 6, .vocab_size = 11, .vocab_multiple = 16};
  // Scaling that changes some frequencies at this size: wavelengths of a
  // 4-wide head are 6.3 and 628 positions, original 8 / high_freq_factor 2 = 4
  // keeps none, original / low_freq_factor = 8 divides the long one.
  d.rope = RopeConfig{10000.0, RopeScaling::llama3(4, 1, 2, 8)};
  d.norm_eps = 1e-5;
  d.tie_embeddings = tied;
  return d;
}

template <class Model>
struct Tiny {
  ModelDims shape;
  ChunkBatch batch{2, 5, 1};
  ChunkInArenas<Model> built;
  Model& model = built.model;
  std::vector<int32_t> tokens, targets;
  Tensor tok, tgt;

  Tiny(DType dt, bool tied)
      : shape(tiny_dims(tied, std::is_same_v<Model, Qwen3>)), built(shape, ChunkPlacement::whole(shape.n_layer), dt, batch) {
    const int64_t n = int64_t(batch.micro_batch) * batch.seq_len;
    for (int64_t i = 0; i < n; ++i) {
      tokens.push_back(int32_t(rng_below(7, 1, uint64_t(i), uint64_t(shape.vocab_size))));
      targets.push_back(int32_t(rng_below(7, 2, uint64_t(i), uint64_t(shape.vocab_size))));
    }
    tok = Tensor(tokens.data(), {batch.micro_batch, batch.seq_len}, DType::I32);
    tgt = Tensor(targets.data(), {batch.micro_batch, batch.seq_len}, DType::I32);
  }

  double loss() {
    model.forward(KernelContext{}, 0, tok, tgt, 0.0);
    return model.take_loss(KernelContext{});
  }
};

using TinyLlama = Tiny<Llama>;
using TinyQwen3 = Tiny<Qwen3>;

template <class Model>
void check_every_parameter(bool tied) {
  Tiny<Model> m(DType::F64, tied);
  randomize_parameters(m.model, 99);
  KernelContext ctx;
  const double n_tokens = double(m.batch.micro_batch) * m.batch.seq_len;
  m.model.forward(ctx, 0, m.tok, m.tgt, 1.0 / n_tokens);
  m.model.take_loss(ctx);
  m.model.backward(ctx, 0, m.tok);

  const double h = 1e-5;
  std::vector<std::string> names;
  for (Parameter& p : m.model.parameters()) {
    names.push_back(p.name);
    double* v = p.value.data<double>();
    const double* g = p.grad.data<double>();
    const int64_t n = p.value.numel();
    // Rows past the real vocabulary get no gradient and are skipped.
    const bool table = p.name == "embed_tokens.weight" || p.name == "lm_head.weight";
    const int64_t limit = table ? int64_t(m.shape.vocab_size) * m.shape.d_model : n;
    const int64_t samples = std::min<int64_t>(16, limit);
    for (int64_t k = 0; k < samples; ++k) {
      const int64_t i = samples == limit ? k : int64_t(rng_below(5, name_stream(p.name), uint64_t(k), uint64_t(limit)));
      const double fd = test::central_difference(v[i], h, [&] { return m.loss(); });
      const double rel = std::abs(fd - g[i]) / std::max(1e-7, std::abs(fd) + std::abs(g[i]));
      EXPECT_LT(rel, 1e-5) << p.name << "[" << i << "]: finite difference " << fd << ", backward " << g[i];
    }
    double norm = 0;
    for (int64_t i = 0; i < limit; ++i) norm += g[i] * g[i];
    EXPECT_GT(norm, 1e-12) << p.name << " has an all-zero gradient";
  }
  std::vector<std::string> want = {"embed_tokens.weight"};
  const bool qk_norm = std::is_same_v<Model, Qwen3>;
  for (int l = 0; l < m.shape.n_layer; ++l)
    for (const char* s : {"input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.q_norm.weight",
                          "self_attn.k_norm.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                          "mlp.gate_up_proj.weight", "mlp.down_proj.weight"})
      if (qk_norm || std::string(s).find("_norm.") == std::string::npos)
        want.push_back("layers." + std::to_string(l) + "." + s);
  want.push_back("norm.weight");
  if (!tied) want.push_back("lm_head.weight");
  EXPECT_EQ(names, want);
}

TEST(LlamaGradCheck, EveryParameterTensorMatchesFiniteDifferencesUntied) { check_every_parameter<Llama>(false); }
TEST(LlamaGradCheck, EveryParameterTensorMatchesFiniteDifferencesTied) { check_every_parameter<Llama>(true); }
TEST(Qwen3GradCheck, EveryParameterTensorMatchesFiniteDifferencesUntied) { check_every_parameter<Qwen3>(false); }
TEST(Qwen3GradCheck, EveryParameterTensorMatchesFiniteDifferencesTied) { check_every_parameter<Qwen3>(true); }

// The loss of the model's forward against a direct float64 transcription of
// transformers' LlamaForCausalLM (modeling_llama.py): RMSNorm, rotate-half
// RoPE, grouped-query attention with query head h on key/value head
// h / (H / KV), SwiGLU with silu on the gate, an untied or tied head; for
// Qwen3ForCausalLM (modeling_qwen3.py) the same with q_norm and k_norm
// (RMSNorm over each head's D) applied to q and k before the rotation, and
// heads D = head_dim wide (o_proj maps H D back to C).
template <class Model>
double reference_loss(Tiny<Model>& m) {
  const ModelDims& d = m.shape;
  const int64_t C = d.d_model, H = d.n_head, KV = d.kv_heads(), D = d.head_size(), F = d.ffn_hidden,
                V = d.vocab_size;
  const int64_t B = m.batch.micro_batch, T = m.batch.seq_len;
  std::map<std::string, const double*> w;
  for (Parameter& p : m.model.parameters()) w[p.name] = p.value.data<double>();
  const double* head = w.count("lm_head.weight") ? w["lm_head.weight"] : w["embed_tokens.weight"];
  const std::vector<double> freq = rope_frequencies(d.rope, D);
  // Rows of `width` normalized in place.
  auto rmsnorm_rows = [&](double* x, int64_t rows, int64_t width, const double* g) {
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < width; ++j) ss += x[r * width + j] * x[r * width + j];
      const double rstd = 1 / std::sqrt(ss / double(width) + d.norm_eps);
      for (int64_t j = 0; j < width; ++j) x[r * width + j] = x[r * width + j] * rstd * g[j];
    }
  };
  auto rmsnorm = [&](const std::vector<double>& x, const double* g) {
    std::vector<double> y = x;
    rmsnorm_rows(y.data(), int64_t(x.size()) / C, C, g);
    return y;
  };
  // y (rows, out) = x (rows, in) W^T with W (out, in).
  auto matmul = [](const std::vector<double>& x, const double* W, int64_t in, int64_t out) {
    const int64_t rows = int64_t(x.size()) / in;
    std::vector<double> y(size_t(rows * out), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) y[r * out + o] += x[r * in + i] * W[o * in + i];
    return y;
  };
  auto rotate = [&](double* head_row, int64_t pos) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double c = std::cos(double(pos) * freq[size_t(i)]), s = std::sin(double(pos) * freq[size_t(i)]);
      const double a = head_row[i], b = head_row[i + D / 2];
      head_row[i] = a * c - b * s;
      head_row[i + D / 2] = b * c + a * s;
    }
  };
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> x(size_t(T * C));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < C; ++j) x[t * C + j] = w["embed_tokens.weight"][m.tokens[b * T + t] * C + j];
    for (int l = 0; l < d.n_layer; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      std::vector<double> qkv = matmul(rmsnorm(x, w[p + "input_layernorm.weight"]), w[p + "self_attn.qkv_proj.weight"],
                                       C, (H + 2 * KV) * D);
      const int64_t W3 = (H + 2 * KV) * D;
      if (w.count(p + "self_attn.q_norm.weight"))
        for (int64_t t = 0; t < T; ++t) {
          rmsnorm_rows(&qkv[t * W3], H, D, w[p + "self_attn.q_norm.weight"]);
          rmsnorm_rows(&qkv[t * W3 + H * D], KV, D, w[p + "self_attn.k_norm.weight"]);
        }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H + KV; ++h) rotate(&qkv[t * W3 + h * D], t);  // q heads, then k heads
      std::vector<double> att(size_t(T * H * D), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kvh = h / (H / KV);
        for (int64_t t = 0; t < T; ++t) {
          std::vector<double> s(size_t(t + 1));
          double mx = -1e300, sum = 0;
          for (int64_t u = 0; u <= t; ++u) {
            double dot = 0;
            for (int64_t i = 0; i < D; ++i) dot += qkv[t * W3 + h * D + i] * qkv[u * W3 + (H + kvh) * D + i];
            s[size_t(u)] = dot / std::sqrt(double(D));
            mx = std::max(mx, s[size_t(u)]);
          }
          for (auto& e : s) sum += (e = std::exp(e - mx));
          for (int64_t u = 0; u <= t; ++u)
            for (int64_t i = 0; i < D; ++i)
              att[t * H * D + h * D + i] += s[size_t(u)] / sum * qkv[u * W3 + (H + KV + kvh) * D + i];
        }
      }
      const std::vector<double> o = matmul(att, w[p + "self_attn.o_proj.weight"], H * D, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
      const std::vector<double> gu =
          matmul(rmsnorm(x, w[p + "post_attention_layernorm.weight"]), w[p + "mlp.gate_up_proj.weight"], C, 2 * F);
      std::vector<double> a(size_t(T * F));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t f = 0; f < F; ++f) {
          const double g = gu[t * 2 * F + f], u = gu[t * 2 * F + F + f];
          a[t * F + f] = g / (1 + std::exp(-g)) * u;
        }
      const std::vector<double> down = matmul(a, w[p + "mlp.down_proj.weight"], F, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
    }
    const std::vector<double> logits = matmul(rmsnorm(x, w["norm.weight"]), head, C, V);
    for (int64_t t = 0; t < T; ++t) {
      double mx = -1e300, sum = 0;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, logits[t * V + v]);
      for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[t * V + v] - mx);
      loss += std::log(sum) + mx - logits[t * V + m.targets[b * T + t]];
    }
  }
  return loss / double(B * T);
}

TEST(Llama, ForwardMatchesADirectTranscriptionOfTransformers) {
  for (bool tied : {false, true}) {
    TinyLlama m(DType::F64, tied);
    randomize_parameters(m.model, 5);
    const double want = reference_loss(m);
    EXPECT_NEAR(m.loss(), want, 1e-12 * std::abs(want)) << (tied ? "tied" : "untied");
  }
}

TEST(Qwen3, ForwardMatchesADirectTranscriptionOfTransformers) {
  for (bool tied : {false, true}) {
    TinyQwen3 m(DType::F64, tied);
    randomize_parameters(m.model, 5);
    const double want = reference_loss(m);
    EXPECT_NEAR(m.loss(), want, 1e-12 * std::abs(want)) << (tied ? "tied" : "untied");
    // The q/k norm matters: with its weights at 1 the loss moves.
    for (Parameter& p : m.model.parameters())
      if (p.name.find("self_attn.q_norm") != std::string::npos)
        for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<double>()[i] = 1.0;
    EXPECT_GT(std::abs(m.loss() - want), 1e-6 * std::abs(want));
  }
}

TEST(Qwen3, ShapesOfTheAttentionWithItsOwnHeadWidth) {
  TinyQwen3 m(DType::F32, false);
  const int64_t C = 16, D = 6, H = 4, KV = 2;
  int norms = 0;
  for (auto& p : m.model.parameters()) {
    if (p.name == "layers.0.self_attn.qkv_proj.weight") EXPECT_EQ(p.shard.global, (Shape{(H + 2 * KV) * D, C}));
    if (p.name == "layers.0.self_attn.o_proj.weight") EXPECT_EQ(p.shard.global, (Shape{C, H * D}));
    if (p.name.find("self_attn.q_norm") != std::string::npos || p.name.find("self_attn.k_norm") != std::string::npos) {
      EXPECT_EQ(p.shard.global, (Shape{D}));
      ++norms;
    }
  }
  EXPECT_EQ(norms, 2 * m.shape.n_layer);
  // tp = 2: the q/k norm weights are whole on every rank.
  for (const Parameter& p : model_arch("qwen3").parameters(m.shape, ChunkPlacement::whole(2), 2, 1)) {
    if (p.name == "layers.1.self_attn.k_norm.weight") EXPECT_EQ(p.value.shape(), (Shape{D}));
  }
}

TEST(Llama, ShapesOfTheFusedProjections) {
  TinyLlama m(DType::F32, false);
  const int64_t C = 16, D = 4, H = 4, KV = 2, F = 24;
  for (auto& p : m.model.parameters()) {
    if (p.name == "layers.0.self_attn.qkv_proj.weight") {
      EXPECT_EQ(p.shard.global, (Shape{(H + 2 * KV) * D, C}));
    } else if (p.name == "layers.0.mlp.gate_up_proj.weight") {
      EXPECT_EQ(p.shard.global, (Shape{2 * F, C}));
    } else if (p.name == "layers.0.mlp.down_proj.weight") {
      EXPECT_EQ(p.shard.global, (Shape{C, F}));
    }
    EXPECT_EQ(p.name.find("bias"), std::string::npos) << "LLaMA has no biases: " << p.name;
  }
  // tp = 2: q, k and v blocks each halve (a rank holds 2 query heads and 1 key/value head).
  for (const Parameter& p : llama_parameters(m.shape, ChunkPlacement::whole(2), 2, 1))
    if (p.name == "layers.1.self_attn.qkv_proj.weight") {
      EXPECT_EQ(p.value.shape(), (Shape{(H + 2 * KV) * D / 2, C}));
      EXPECT_EQ(p.shard.block_sizes, (std::vector<int64_t>{H * D, KV * D, KV * D}));
      // Local row 0 is global q row H D / 2; local row H D / 2 is global k row KV D / 2.
      EXPECT_EQ(p.shard.global_index(p.value.shape(), 0), H * D / 2 * C);
      EXPECT_EQ(p.shard.global_index(p.value.shape(), H * D / 2 * C), (H * D + KV * D / 2) * C);
    }
}

TEST(Llama, Float32ForwardTracksFloat64) {
  TinyLlama a(DType::F64, false), b(DType::F32, false);
  randomize_parameters(a.model, 11);
  randomize_parameters(b.model, 11);
  EXPECT_NEAR(a.loss(), b.loss(), 1e-5 * std::abs(a.loss()));
}

template <class Model>
void check_init() {
  Tiny<Model> a(DType::F64, false);
  a.model.init_parameters(42);
  for (const Parameter& p : a.model.parameters()) {
    SCOPED_TRACE(p.name);
    const double* v = p.value.data<double>();
    const bool norm = p.name.find("layernorm") != std::string::npos || p.name == "norm.weight" ||
                      p.name.find("_norm.weight") != std::string::npos;
    const bool table = p.name == "embed_tokens.weight" || p.name == "lm_head.weight";
    for (int64_t i = 0; i < p.value.numel(); i += 5) {
      if (norm) ASSERT_EQ(v[i], 1.0);
      else if (table && i >= int64_t(a.shape.vocab_size) * a.shape.d_model) ASSERT_EQ(v[i], 0.0) << "padding row";
      else ASSERT_EQ(v[i], 0.02 * rng_normal(42, name_stream(p.name), uint64_t(i)));
    }
  }
}
TEST(Llama, InitIsAFunctionOfSeedNameAndIndex) { check_init<Llama>(); }
TEST(Qwen3, InitIsAFunctionOfSeedNameAndIndex) { check_init<Qwen3>(); }

TEST(Llama, MetasMlpWidthRule) {
  EXPECT_EQ(llama_ffn_hidden(4096, 1024, 1.3), 14336);  // Llama 3 8B
  EXPECT_EQ(llama_ffn_hidden(4096, 256, 0), 11008);     // Llama 2 7B
  EXPECT_EQ(llama_ffn_hidden(8192, 4096, 1.3), 28672);  // Llama 3 70B
  ModelDims d = tiny_dims(false);
  d.ffn_hidden = 0;
  d.ffn_multiple_of = 32;
  EXPECT_EQ(llama_ffn_hidden(d), 64);  // 2 x 64 / 3 = 42, up to 64
}

TEST(Llama, TheLlama3_8bConfigHasTheRealShape) {
  Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/llama3_8b.yaml");
  const ModelDims& d = c.model;
  EXPECT_EQ(d.arch, "llama");
  EXPECT_EQ(llama_ffn_hidden(d), 14336);
  EXPECT_EQ(d.kv_heads(), 8);
  EXPECT_EQ(d.rope.theta, 500000.0);
  EXPECT_EQ(d.rope.scaling.type, RopeScaling::Type::Llama3);
  EXPECT_FALSE(d.tie_embeddings.value_or(true));
  int64_t n = 0;
  for (const Parameter& p : model_arch("llama").parameters(d, ChunkPlacement::whole(d.n_layer), 1, 0))
    n += p.shard.global.numel();
  EXPECT_EQ(n, 8030261248);  // Meta-Llama-3-8B's parameter count
  // The 8B shape's training FLOPs per token at 8192 tokens: 6 N (less the
  // embedding, which has no products) + 12 L C T.
  Llama layout(d, ChunkPlacement::whole(d.n_layer), DType::BF16, ChunkBatch{1, 8192, 1}, TensorParallel{nullptr, false, 8, 0});
  const double matrices = double(n) - 128256.0 * 4096 - (2.0 * 32 + 1) * 4096;
  EXPECT_NEAR(layout.flops_per_token(), 6 * matrices + 12.0 * 32 * 4096 * 8192, 1.0);
}

TEST(Llama, DebugConfigsHaveGroupedQueryAttention) {
  for (const char* arch : {"llama", "qwen3"}) {
    Config c = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/" + arch + "_debug.yaml");
    const ModelDims& d = c.model;
    EXPECT_EQ(d.arch, arch);
    EXPECT_LT(d.kv_heads(), d.n_head);
    for (int tp : {1, 2, 4})
      for (int pp : {1, 2}) EXPECT_EQ(layout_problem(d, ParallelLayout{1, tp, pp, 1}), "") << tp << " " << pp;
    EXPECT_EQ(layout_problem(d, ParallelLayout{1, 1, 2, 2}), "");
  }
  // Qwen3's heads are their own width; rotary embeddings need it even.
  ModelDims q = load_config(std::string(XIRANG_SOURCE_DIR) + "/configs/qwen3_debug.yaml").model;
  EXPECT_NE(q.head_size() * q.n_head, q.d_model);
  q.head_dim = 7;
  EXPECT_NE(layout_problem(q, ParallelLayout{}).find("model.head_dim=7 is odd"), std::string::npos);
}

}  // namespace
}  // namespace xirang
