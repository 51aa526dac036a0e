// The per-op profile on a device (metrics.op_profile): public ops called with
// a CUDA KernelContext that carries a profiling Timeline are timed by a pair
// of events on the context's stream, each under its kind, once (the fused
// linear + GELU pair is one matmul), and take_ops() reads the times after
// waiting for the last op: positive, and no longer than the host's wall
// time around the work.
#include <chrono>
#include <thread>

#include "core/clock.h"
#include "kernels/adamw.h"
#include "kernels/elementwise.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"
#include "tests/cuda/cuda_test_util.h"

namespace xirang::test {
namespace {

class OpProfileCudaTest : public CudaTest {};

TEST_F(OpProfileCudaTest, OpsAreTimedOnTheStreamByKind) {
  constexpr int64_t N = 512, C = 1024;
  const DType s = DType::BF16;
  DeviceTensor x = to_device(random_host({N, C}, s, 1)), w = to_device(random_host({C, C}, s, 2));
  DeviceTensor bias = to_device(random_host({C}, s, 3)), y(Shape{N, C}, s), pre(Shape{N, C}, s);
  DeviceTensor lw = to_device(random_host({C}, s, 4)), lb = to_device(random_host({C}, s, 5));
  DeviceTensor mean(Shape{N}, DType::F32), rstd(Shape{N}, DType::F32);
  DeviceTensor p = to_device(random_host({C, C}, DType::F32, 6)), g = to_device(random_host({C, C}, DType::F32, 7));
  DeviceTensor m = to_device(random_host({C, C}, DType::F32, 8, 0.0)), v = to_device(random_host({C, C}, DType::F32, 9, 0.0));
  sync();

  Timeline tl;
  tl.set_profiling(true);
  KernelContext c = ctx();
  c.timeline = &tl;
  const double t0 = now_seconds();
  for (int i = 0; i < 3; ++i) matmul(c, y, x, w, false, true);
  linear_gelu_forward(c, y, pre, x, w, bias);  // one matmul, not a GELU as well
  layernorm_forward(c, y, mean, rstd, x, lw, lb);
  gelu_forward(c, y, pre);
  const double squares = sum_squares(c, g);  // waits for its result on the host
  AdamWStep st;
  st.lr = 1e-3;
  adamw_update(c, p, g, m, v, st);
  const OpTimes t = tl.take_ops();  // waits for the last op's end event
  const double wall_ms = (now_seconds() - t0) * 1e3;
  EXPECT_GT(squares, 0.0);

  const struct {
    OpKind kind;
    int64_t calls;
  } expected[] = {{OpKind::Matmul, 4}, {OpKind::Norm, 1}, {OpKind::Elementwise, 2}, {OpKind::Optimizer, 1}};
  double sum_ms = 0;
  for (int k = 0; k < kOpKindCount; ++k) {
    int64_t want = 0;
    for (const auto& e : expected)
      if (int(e.kind) == k) want = e.calls;
    EXPECT_EQ(t.calls[size_t(k)], want) << op_kind_name(OpKind(k));
    if (want > 0) {
      EXPECT_GT(t.ms[size_t(k)], 0.0) << op_kind_name(OpKind(k));
    } else {
      EXPECT_EQ(t.ms[size_t(k)], 0.0) << op_kind_name(OpKind(k));
    }
    sum_ms += t.ms[size_t(k)];
  }
  // Four (512 x 1024) x (1024 x 1024) products are the most of this work.
  EXPECT_GT(t.ms[size_t(OpKind::Matmul)], t.ms[size_t(OpKind::Norm)]);
  // The events bracket work the host waited for: their sum fits in its wall time.
  EXPECT_LE(sum_ms, wall_ms * 1.01 + 0.05);
  EXPECT_EQ(tl.op_depth(), 0);

  // A new count; ops without profiling record nothing.
  EXPECT_EQ(tl.take_ops().calls[size_t(OpKind::Matmul)], 0);
  tl.set_profiling(false);
  matmul(c, y, x, w, false, true);
  sync();
  EXPECT_EQ(tl.take_ops().calls[size_t(OpKind::Matmul)], 0);
}

// The events time the device: a kernel queued behind a host-side delay is
// not charged for the delay, only for its own run.
TEST_F(OpProfileCudaTest, EventTimeIsTheDevicesNotTheHosts) {
  constexpr int64_t n = 1 << 20;
  DeviceTensor x = to_device(random_host({n}, DType::F32, 11));
  sync();
  Timeline tl;
  tl.set_profiling(true);
  KernelContext c = ctx();
  c.timeline = &tl;
  for (int i = 0; i < 20; ++i) scale(c, x, 0.5);  // warm up the pool of events and the kernel
  tl.take_ops();
  scale(c, x, 0.5);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the stream is idle meanwhile
  const OpTimes t = tl.take_ops();
  ASSERT_EQ(t.calls[size_t(OpKind::Elementwise)], 1);
  EXPECT_GT(t.ms[size_t(OpKind::Elementwise)], 0.0);
  EXPECT_LT(t.ms[size_t(OpKind::Elementwise)], 50.0);  // a 4 MiB scale takes microseconds on any GPU
}

}  // namespace
}  // namespace xirang::test
