// Every public op adds its call to the profiling timeline of its context
// (metrics.op_profile), once, under its kind: a fused or composed op (the
// linear + GELU pair, the single-rank embedding) is one call of the outer
// kind, not of the ops it is built from. Without a timeline, or with
// profiling off, nothing is recorded.
#include <deque>
#include <functional>
#include <string>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"
#include "tests/kernels/reference.h"

namespace xirang::test {
namespace {

constexpr int64_t B = 1, T = 4, N = B * T, C = 8, H = 2, V = 16;

// Float inputs and outputs of the shapes above, alive as long as the pool.
class Pool {
 public:
  Tensor f32(Shape s, uint64_t seed) {
    floats_.push_back(cast_vec<float>(randn(size_t(s.numel()), seed, 0.5)));
    return view(floats_.back(), s);
  }
  Tensor f64(Shape s) {
    doubles_.emplace_back(size_t(s.numel()), 0.0);
    return view(doubles_.back(), s);
  }
  Tensor tokens(Shape s) {
    ints_.push_back(rand_int(size_t(s.numel()), 7, 0, int32_t(V)));
    return view(ints_.back(), s);
  }

 private:
  std::deque<std::vector<float>> floats_;
  std::deque<std::vector<double>> doubles_;
  std::deque<std::vector<int32_t>> ints_;
};

struct OpCase {
  std::string name;
  OpKind kind;
  std::function<void(const KernelContext&, Pool&)> run;
};

std::vector<OpCase> op_cases() {
  const GradMode ow = GradMode::Overwrite;
  return {
      {"matmul", OpKind::Matmul,
       [](auto& c, Pool& p) { matmul(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({C, C}, 3), false, false); }},
      {"linear_forward", OpKind::Matmul,
       [](auto& c, Pool& p) { linear_forward(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({C, C}, 3), p.f32({C}, 4)); }},
      {"linear_backward", OpKind::Matmul,
       [ow](auto& c, Pool& p) {
         linear_backward(c, p.f32({N, C}, 1), p.f32({C, C}, 2), p.f32({C}, 3), p.f32({N, C}, 4), p.f32({N, C}, 5),
                         p.f32({C, C}, 6), ow);
       }},
      {"linear_gelu_forward", OpKind::Matmul,
       [](auto& c, Pool& p) {
         linear_gelu_forward(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({N, C}, 3), p.f32({C, C}, 4),
                             p.f32({C}, 5));
       }},
      {"linear_gelu_backward", OpKind::Matmul,
       [ow](auto& c, Pool& p) {
         linear_gelu_backward(c, p.f32({N, C}, 1), p.f32({C, C}, 2), p.f32({C}, 3), p.f32({N, C}, 4),
                              p.f32({N, C}, 5), p.f32({N, C}, 6), p.f32({N, C}, 7), p.f32({C, C}, 8), ow);
       }},
      {"attention_forward", OpKind::Attention,
       [](auto& c, Pool& p) {
         attention_forward(c, p.f32({B, T, C}, 1), p.f32({B, H, T, T}, 2), p.f32({B, T, 3 * C}, 3), int(H));
       }},
      {"attention_backward", OpKind::Attention,
       [](auto& c, Pool& p) {
         attention_backward(c, p.f32({B, T, 3 * C}, 1), p.f32({B, T, C}, 2), p.f32({B, T, 3 * C}, 3),
                            p.f32({B, H, T, T}, 4), int(H));
       }},
      {"flash_attention_forward", OpKind::Attention,
       [](auto& c, Pool& p) {
         flash_attention_forward(c, p.f32({B, T, C}, 1), p.f32({B, H, T}, 2), p.f32({B, T, 3 * C}, 3), int(H));
       }},
      {"flash_attention_backward", OpKind::Attention,
       [](auto& c, Pool& p) {
         flash_attention_backward(c, p.f32({B, T, 3 * C}, 1), p.f32({B, T, C}, 2), p.f32({B, T, 3 * C}, 3),
                                  p.f32({B, T, C}, 4), p.f32({B, H, T}, 5), int(H));
       }},
      {"layernorm_forward", OpKind::Norm,
       [](auto& c, Pool& p) {
         layernorm_forward(c, p.f32({N, C}, 1), p.f32({N}, 2), p.f32({N}, 3), p.f32({N, C}, 4), p.f32({C}, 5),
                           p.f32({C}, 6));
       }},
      {"residual_layernorm_forward", OpKind::Norm,
       [](auto& c, Pool& p) {
         residual_layernorm_forward(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({N}, 3), p.f32({N}, 4),
                                    p.f32({N, C}, 5), p.f32({N, C}, 6), p.f32({C}, 7), p.f32({C}, 8));
       }},
      {"layernorm_backward", OpKind::Norm,
       [ow](auto& c, Pool& p) {
         layernorm_backward(c, p.f32({N, C}, 1), p.f32({C}, 2), p.f32({C}, 3), p.f32({N, C}, 4), p.f32({N, C}, 5),
                            p.f32({C}, 6), p.f32({N}, 7), p.f32({N}, 8), ow);
       }},
      {"cross_entropy_forward_backward", OpKind::Loss,
       [](auto& c, Pool& p) {
         cross_entropy_forward_backward(c, p.f32({N}, 1), p.f32({N, V}, 2), p.f32({N, V}, 3), p.tokens({N}), V, 1.0);
       }},
      {"cross_entropy_shard_max", OpKind::Loss,
       [](auto& c, Pool& p) { cross_entropy_shard_max(c, p.f32({N}, 1), p.f32({N, V}, 2), 0, V); }},
      {"cross_entropy_shard_sums", OpKind::Loss,
       [](auto& c, Pool& p) {
         cross_entropy_shard_sums(c, p.f32({N, 2}, 1), p.f32({N, V}, 2), p.tokens({N}), p.f32({N}, 3), 0, V);
       }},
      {"cross_entropy_shard_finish", OpKind::Loss,
       [](auto& c, Pool& p) {
         Tensor sums = p.f32({N, 2}, 1);
         for (int64_t i = 0; i < 2 * N; ++i) sums.data<float>()[i] = 1.0f + float(i);  // positive sums
         cross_entropy_shard_finish(c, p.f32({N}, 2), p.f32({N, V}, 3), p.f32({N, V}, 4), p.tokens({N}),
                                    p.f32({N}, 5), sums, 0, V, 1.0);
       }},
      {"embedding_forward", OpKind::Embedding,
       [](auto& c, Pool& p) {
         embedding_forward(c, p.f32({B, T, C}, 1), p.tokens({B, T}), p.f32({V, C}, 2), p.f32({T, C}, 3));
       }},
      {"embedding_backward", OpKind::Embedding,
       [](auto& c, Pool& p) {
         embedding_backward(c, p.f32({V, C}, 1), p.f32({T, C}, 2), p.f32({B, T, C}, 3), p.tokens({B, T}));
       }},
      {"embedding_lookup", OpKind::Embedding,
       [](auto& c, Pool& p) { embedding_lookup(c, p.f32({N, C}, 1), p.tokens({N}), p.f32({V, C}, 2), 0, V); }},
      {"embedding_lookup_backward", OpKind::Embedding,
       [](auto& c, Pool& p) {
         embedding_lookup_backward(c, p.f32({V, C}, 1), p.f32({N, C}, 2), p.tokens({N}), 0, V);
       }},
      {"add_positions", OpKind::Embedding,
       [](auto& c, Pool& p) { add_positions(c, p.f32({N, C}, 1), p.f32({T, C}, 2), T, 0); }},
      {"add_positions_backward", OpKind::Embedding,
       [](auto& c, Pool& p) { add_positions_backward(c, p.f32({T, C}, 1), p.f32({N, C}, 2), T, 0); }},
      {"gelu_forward", OpKind::Elementwise,
       [](auto& c, Pool& p) { gelu_forward(c, p.f32({N, C}, 1), p.f32({N, C}, 2)); }},
      {"gelu_backward", OpKind::Elementwise,
       [](auto& c, Pool& p) { gelu_backward(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({N, C}, 3)); }},
      {"add_bias", OpKind::Elementwise, [](auto& c, Pool& p) { add_bias(c, p.f32({N, C}, 1), p.f32({C}, 2)); }},
      {"add", OpKind::Elementwise,
       [](auto& c, Pool& p) { add(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({N, C}, 3)); }},
      {"scale", OpKind::Elementwise, [](auto& c, Pool& p) { scale(c, p.f32({N, C}, 1), 0.5); }},
      {"zero", OpKind::Elementwise, [](auto& c, Pool& p) { zero(c, p.f32({N, C}, 1)); }},
      {"cast", OpKind::Elementwise, [](auto& c, Pool& p) { cast(c, p.f64({N, C}), p.f32({N, C}, 1)); }},
      {"sum_squares", OpKind::Elementwise, [](auto& c, Pool& p) { (void)sum_squares(c, p.f32({N, C}, 1)); }},
      {"all_finite", OpKind::Elementwise, [](auto& c, Pool& p) { (void)all_finite(c, p.f32({N, C}, 1)); }},
      {"sum_squares_accumulate", OpKind::Elementwise,
       [](auto& c, Pool& p) { sum_squares_accumulate(c, p.f64({1}), p.f32({N, C}, 1)); }},
      {"mean_accumulate", OpKind::Elementwise,
       [](auto& c, Pool& p) { mean_accumulate(c, p.f64({1}), p.f32({N, C}, 1)); }},
      {"adamw_update", OpKind::Optimizer,
       [](auto& c, Pool& p) {
         AdamWStep s;
         s.lr = 1e-3;
         Tensor v = p.f32({N, C}, 4);
         for (int64_t i = 0; i < N * C; ++i) v.data<float>()[i] *= v.data<float>()[i];  // second moments >= 0
         adamw_update(c, p.f32({N, C}, 1), p.f32({N, C}, 2), p.f32({N, C}, 3), v, s);
       }},
  };
}

TEST(OpProfileTest, EachOpIsOneCallOfItsKind) {
  for (const OpCase& op : op_cases()) {
    SCOPED_TRACE(op.name);
    Timeline tl;
    tl.set_profiling(true);
    KernelContext ctx;
    ctx.timeline = &tl;
    Pool pool;
    op.run(ctx, pool);
    EXPECT_EQ(tl.op_depth(), 0);
    const OpTimes t = tl.take_ops();
    for (int k = 0; k < kOpKindCount; ++k) {
      const OpKind kind = OpKind(k);
      EXPECT_EQ(t.calls[size_t(k)], kind == op.kind ? 1 : 0) << op_kind_name(kind);
      EXPECT_GE(t.ms[size_t(k)], 0.0) << op_kind_name(kind);
      if (kind != op.kind) {
        EXPECT_EQ(t.ms[size_t(k)], 0.0) << op_kind_name(kind);
      }
    }
  }
}

// Every public op is in the table above (a new op must choose its kind).
TEST(OpProfileTest, TableCoversTheKernelHeaders) { EXPECT_EQ(op_cases().size(), 34u); }

TEST(OpProfileTest, NothingWithoutTimelineOrProfiling) {
  Timeline off;  // profiling off: the trainer's default, and during evaluation
  for (Timeline* tl : {static_cast<Timeline*>(nullptr), &off}) {
    KernelContext ctx;
    ctx.timeline = tl;
    Pool pool;
    for (const OpCase& op : op_cases()) op.run(ctx, pool);
  }
  const OpTimes t = off.take_ops();
  for (int k = 0; k < kOpKindCount; ++k) EXPECT_EQ(t.calls[size_t(k)], 0) << op_kind_name(OpKind(k));
}

// A failing op (a shape error) still closes its scope: the next op counts.
TEST(OpProfileTest, AnErrorLeavesTheNestingBalanced) {
  Timeline tl;
  tl.set_profiling(true);
  KernelContext ctx;
  ctx.timeline = &tl;
  Pool pool;
  EXPECT_THROW(gelu_forward(ctx, pool.f32({N, C}, 1), pool.f32({N, C + 1}, 2)), Error);
  EXPECT_EQ(tl.op_depth(), 0);
  gelu_forward(ctx, pool.f32({N, C}, 1), pool.f32({N, C}, 2));
  EXPECT_EQ(tl.take_ops().calls[size_t(OpKind::Elementwise)], 2);
}

}  // namespace
}  // namespace xirang::test
