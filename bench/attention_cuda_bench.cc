// bench/attention_cuda_bench.cc: the CUDA flash attention's forward and
// backward on a training shape, tensor-core path against the fp32 one, timed
// with events on the stream (median of --reps after a warm-up), with the
// achieved TFLOP/s (causal: half the square's products).
//
//   build/bin/attention_cuda_bench --B 16 --T 1024 --H 12 --D 64 --dtype bf16 --reps 20
//
// Its peer is `python3 bench/torch_gpt2_cuda.py --attention-only` (PyTorch's
// scaled_dot_product_attention on the same shape). Exit status 77 without a
// GPU or without the CUDA backend.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/error.h"

#ifdef XIRANG_HAVE_CUDA
#include "core/cuda_stream.h"
#include "core/device_memory.h"
#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/ops.h"
#include "kernels/elementwise.h"
#endif

using namespace xirang;

namespace {

struct Options {
  int64_t B = 16, T = 1024, H = 12, D = 64;
  int reps = 20;
  DType dtype = DType::BF16;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--B") o.B = std::atoll(v.c_str());
    else if (k == "--T") o.T = std::atoll(v.c_str());
    else if (k == "--H") o.H = std::atoll(v.c_str());
    else if (k == "--D") o.D = std::atoll(v.c_str());
    else if (k == "--reps") o.reps = std::atoi(v.c_str());
    else if (k == "--dtype") o.dtype = v == "f16" ? DType::F16 : DType::BF16;
    else {
      std::fprintf(stderr, "attention_cuda_bench: unknown option %s (expected --B --T --H --D --reps --dtype)\n", k.c_str());
      std::exit(2);
    }
  }
  return o;
}

#ifdef XIRANG_HAVE_CUDA
// A device tensor of random values in [-1, 1) (rounded to dtype on the host).
struct DeviceBuffer {
  Tensor t;
  DeviceBuffer(Shape shape, DType dtype, uint64_t seed) {
    Tensor probe(nullptr, shape, dtype);
    const int64_t n = probe.numel();
    std::vector<float> host(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) host[size_t(i)] = float(rng_below(seed, 1, uint64_t(i), 1u << 20)) / float(1 << 19) - 1.f;
    std::vector<char> rounded(size_t(n) * dtype_size(dtype));
    cast(KernelContext{}, Tensor(rounded.data(), shape, dtype), Tensor(host.data(), shape, DType::F32));
    void* p = device_alloc(Device::CUDA, rounded.size(), "bench");
    copy_bytes(p, Device::CUDA, rounded.data(), Device::CPU, rounded.size());
    t = Tensor(p, shape, dtype, Device::CUDA);
  }
  ~DeviceBuffer() { device_free(Device::CUDA, t.raw()); }
};

template <class F>
double median_event_ms(cudaStream_t s, int reps, F&& f) {
  f();  // warm-up: module load, smem attributes
  std::vector<double> ms;
  CudaEvent a(EventTiming::Enabled), b(EventTiming::Enabled);
  for (int r = 0; r < reps; ++r) {
    a.record(s);
    f();
    b.record(s);
    b.synchronize();
    ms.push_back(elapsed_ms(a, b));
  }
  return bench::median(ms);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
#ifndef XIRANG_HAVE_CUDA
  std::fprintf(stderr, "attention_cuda_bench: this build has no CUDA backend\n");
  return 77;
#else
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "attention_cuda_bench: no CUDA device visible\n");
    return 77;
  }
  try {
    CudaContext cuda(0);
    const KernelContext ctx = cuda.kernel_context();
    const int64_t W = 3 * o.H * o.D, C = o.H * o.D;
    DeviceBuffer qkv({o.B, o.T, W}, o.dtype, 1), dout({o.B, o.T, C}, o.dtype, 2);
    DeviceBuffer out({o.B, o.T, C}, o.dtype, 3), dqkv({o.B, o.T, W}, o.dtype, 4), lse({o.B, o.H, o.T}, DType::F32, 5);
    // Causal: Q K^T and P V over half the T x T square, 2 flops a product;
    // backward: the scores again, dV, dP, dQ, dK (2.5x the forward).
    const double fwd_flops = 2.0 * 2.0 * double(o.B) * o.H * o.T * o.T * o.D / 2.0, bwd_flops = 2.5 * fwd_flops;
    std::printf("attention B %lld T %lld H %lld D %lld %s (path for this shape: %s)\n", (long long)o.B,
                (long long)o.T, (long long)o.H, (long long)o.D, dtype_name(o.dtype),
                flash_attention_path_name(Device::CUDA, o.dtype, o.D).c_str());
    std::printf("%-14s %10s %10s %10s %10s\n", "kernels", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s");
    struct Path {
      const char* name;
      void (*fwd)(const KernelContext&, Tensor, Tensor, const Tensor&, int, int);
      void (*bwd)(const KernelContext&, Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, int);
    };
    std::vector<Path> paths = {{"fp32 cores", cuda::flash_attention_forward_fp32, cuda::flash_attention_backward_fp32}};
    if (flash_attention_path(Device::CUDA, o.dtype, o.D) == AttentionPath::TensorCores)
      paths.insert(paths.begin(), {"tensor cores", cuda::flash_attention_forward_tc, cuda::flash_attention_backward_tc});
    for (const Path& p : paths) {
      const int H = int(o.H);
      const double f = median_event_ms(cuda.stream(), o.reps, [&] { p.fwd(ctx, out.t, lse.t, qkv.t, H, H); });
      const double b = median_event_ms(cuda.stream(), o.reps, [&] { p.bwd(ctx, dqkv.t, dout.t, qkv.t, out.t, lse.t, H, H); });
      std::printf("%-14s %10.3f %10.1f %10.3f %10.1f\n", p.name, f, fwd_flops / f / 1e9, b, bwd_flops / b / 1e9);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "attention_cuda_bench: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}
