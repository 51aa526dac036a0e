// CUDA decode attention (kernels/decode_attention.h), storage S in {f32,
// bf16, f16}, arithmetic in float.
//
// Two launches on the context's stream: one thread per element copies the
// new keys and values into the caches; then one block per (batch, query
// head, new token) computes that row. The block's threads take the cached
// positions in turn for the scores (kept in dynamic shared memory, one float
// per position, so T_max is bounded by the shared memory a block may use),
// reduce their maximum and the sum of the exponentials through shared
// memory, and then the head's D outputs, each thread summing p_j v_j over
// every position for its own elements. A simple kernel (the generation step
// is dominated by the matrix products), not a tuned one.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/decode_attention.h"
#include "kernels/decode_attention_checks.h"

namespace xirang::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxPositions = 10 * 1024;  // 40 KiB of float scores per block (48 KiB without opt-in)

template <class S>
__global__ void __launch_bounds__(256)
    append_kernel(S* __restrict__ k_cache, S* __restrict__ v_cache, const S* __restrict__ qkv, int64_t B, int64_t n,
                  int64_t W, int64_t k_off, int64_t v_off, int64_t KVD, int64_t T_max, int64_t pos) {
  const int64_t total = B * n * KVD;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = e % KVD, bt = e / KVD, b = bt / n, t = bt % n;
    const S* row = qkv + bt * W;
    const int64_t at = (b * T_max + pos + t) * KVD + c;
    k_cache[at] = row[k_off + c];
    v_cache[at] = row[v_off + c];
  }
}

constexpr int kRedSlots = 8;  // kThreads / 32 partials and the result, rounded up to 16 bytes
static_assert(kThreads / 32 + 1 <= kRedSlots);

// Bytes of dynamic shared memory for L cached positions.
size_t decode_smem_bytes(int64_t L) { return size_t(kRedSlots + (L + 3) / 4 * 4) * sizeof(float); }

__device__ float block_reduce(float v, float* red, bool is_max) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = red[0];
    for (int i = 1; i < kThreads / 32; ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
    red[kThreads / 32] = r;
  }
  __syncthreads();
  const float r = red[kThreads / 32];
  __syncthreads();  // red is reused by the next reduction
  return r;
}

// Block (b * H + h) * n + i: query head h of new token i of batch row b.
template <class S>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(S* __restrict__ out, const S* __restrict__ k_cache, const S* __restrict__ v_cache,
                  const S* __restrict__ qkv, int64_t n, int64_t H, int64_t group, int64_t D, int64_t W, int64_t C,
                  int64_t KVD, int64_t T_max, int64_t pos, float scale) {
  // One dynamic allocation (decode_smem_bytes): the reduction slots, then
  // the scores, 16-byte aligned and padded to whole float4s, so the vector
  // loads the compiler makes of the scores never leave the allocation.
  extern __shared__ __align__(16) float smem[];
  float* red = smem;
  float* scores = smem + kRedSlots;
  const int64_t i = blockIdx.x % n, bh = blockIdx.x / n, h = bh % H, b = bh / H, g = h / group;
  const int64_t L = pos + i + 1;
  const S* q = qkv + (b * n + i) * W + h * D;
  const S* kb = k_cache + b * T_max * KVD + g * D;
  const S* vb = v_cache + b * T_max * KVD + g * D;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    const S* kr = kb + j * KVD;
    float s = 0.f;
    for (int64_t c = 0; c < D; ++c) s += load(q[c]) * load(kr[c]);
    s *= scale;
    scores[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_reduce(mx, red, true);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    const float e = expf(scores[j] - mx);
    scores[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, red, false);  // also orders the scores' writes before the reads below
  const float inv = 1.f / sum;
  S* orow = out + (b * n + i) * C + h * D;
  for (int64_t c = threadIdx.x; c < D; c += kThreads) {
    float acc = 0.f;
    for (int64_t j = 0; j < L; ++j) acc += scores[j] * load(vb[j * KVD + c]);
    orow[c] = store<S>(acc * inv);
  }
}

}  // namespace

void decode_attention_forward(const KernelContext& ctx, Tensor out, Tensor k_cache, Tensor v_cache, const Tensor& qkv,
                              int64_t pos, int n_head, int n_kv_head) {
  const char* op = "decode_attention_forward";
  require_cuda(ctx, op);
  const auto dd = decode_attention_checks::check(op, out, k_cache, v_cache, qkv, pos, n_head, n_kv_head);
  check_on_device(op, {{"out", &out}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"qkv", &qkv}});
  const auto& d = dd.a;
  if (d.B == 0 || d.T == 0) return;
  if (pos + d.T > kMaxPositions)
    fail(ErrorKind::Shape, op, ": ", pos + d.T, " positions exceed the CUDA kernel's ", kMaxPositions,
         " (its scores live in shared memory)");
  const float scale = float(1.0 / std::sqrt(double(d.D)));
  dispatch_storage(qkv.dtype(), op, [&](auto tag) {
    using S = decltype(tag);
    const int64_t total = d.B * d.T * dd.KVD();
    const unsigned grid = unsigned(std::min<int64_t>(blocks_for(total, 256), int64_t(1) << 20));
    append_kernel<S><<<grid, 256, 0, stream(ctx)>>>(static_cast<S*>(k_cache.raw()), static_cast<S*>(v_cache.raw()),
                                                    static_cast<const S*>(qkv.raw()), d.B, d.T, d.W, d.k_off(0),
                                                    d.v_off(0), dd.KVD(), dd.T_max, pos);
    XR_CUDA_LAUNCH_CHECK();
    const size_t shared = decode_smem_bytes(pos + d.T);
    decode_kernel<S><<<unsigned(d.B * d.H * d.T), kThreads, shared, stream(ctx)>>>(
        static_cast<S*>(out.raw()), static_cast<const S*>(k_cache.raw()), static_cast<const S*>(v_cache.raw()),
        static_cast<const S*>(qkv.raw()), d.T, d.H, d.group(), d.D, d.W, d.C, dd.KVD(), dd.T_max, pos, scale);
    XR_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace xirang::cuda
