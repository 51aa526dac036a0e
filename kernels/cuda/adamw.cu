// CUDA AdamW: one pass reads the gradient (f32, bf16 or f16), updates the
// f32 master weights and both moments in place, and writes the rounded model
// copy when there is one. Same formula and float arithmetic as the CPU
// reference (kernels/cpu/adamw.cc with T = float); the host folds the bias
// corrections into 1 / c1 and 1 / c2 in double and rounds them once.
//
// The grouped form (the optimizer's step) is one launch over all tensors:
// block b updates chunk b, whose record in the device table gives its
// pointers, length and decay flag (kernels/group_table.h). Both forms share
// the element update, so they agree bit for bit.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "core/device_memory.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace xirang::cuda {

namespace {

constexpr int kThreads = 256;

struct AdamWCoeffs {
  float b1, b2, lr, eps, wd, grad_scale, inv_c1, inv_c2;
};

// Element i of one update with weight decay wd (k.wd or 0). C is the model
// copy's storage type (void when there is none); a null copy is skipped.
template <class G, class C>
__device__ __forceinline__ void adamw_element(float* __restrict__ p, const G* __restrict__ grad,
                                              float* __restrict__ m, float* __restrict__ v, C* copy, int64_t i,
                                              const AdamWCoeffs& k, float wd) {
  const float g = load(grad[i]) * k.grad_scale;
  const float mi = k.b1 * m[i] + (1.f - k.b1) * g;
  const float vi = k.b2 * v[i] + (1.f - k.b2) * g * g;
  m[i] = mi;
  v[i] = vi;
  const float pi = p[i];
  const float update = (mi * k.inv_c1) / (sqrtf(vi * k.inv_c2) + k.eps) + wd * pi;
  const float next = pi - k.lr * update;
  p[i] = next;
  if constexpr (!std::is_void_v<C>) {
    if (copy) copy[i] = store<C>(next);
  }
}

template <class G, class C>
__global__ void adamw_kernel(float* __restrict__ p, const G* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, C* copy, int64_t n, AdamWCoeffs k) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    adamw_element(p, grad, m, v, copy, i, k, k.wd);
}

// One chunk of one tensor of a group: at most kGroupChunk elements.
struct AdamWChunk {
  float* p;         // (n) the master
  const void* g;    // (n) gradient, the group's G
  float* m;         // (n)
  float* v;         // (n)
  void* copy;       // (n) model copy, the group's C; null: none
  int32_t n;        // elements
  int32_t decay;    // 1: weight decay applies
};
static_assert(sizeof(AdamWChunk) <= size_t(kGroupRecordBytes), "AdamW chunk record outgrew the group table");
static_assert(kGroupChunk <= INT32_MAX, "chunk length must fit the record");

// Block b updates chunk b; its threads stride over the chunk.
template <class G, class C>
__global__ void adamw_group_kernel(const AdamWChunk* __restrict__ chunks, AdamWCoeffs k) {
  const AdamWChunk c = chunks[blockIdx.x];
  const float wd = c.decay ? k.wd : 0.f;
  const G* g = static_cast<const G*>(c.g);
  C* copy = static_cast<C*>(c.copy);
  for (int i = int(threadIdx.x); i < c.n; i += int(blockDim.x)) adamw_element(c.p, g, c.m, c.v, copy, i, k, wd);
}

AdamWCoeffs coefficients(const AdamWStep& s) {
  const double c1 = 1.0 - std::pow(s.beta1, double(s.step));
  const double c2 = 1.0 - std::pow(s.beta2, double(s.step));
  return AdamWCoeffs{float(s.beta1),        float(s.beta2),      float(s.lr),       float(s.eps),
                     float(s.weight_decay), float(s.grad_scale), float(1.0 / c1), float(1.0 / c2)};
}

// The model copy of t that needs writing: none when undefined or the master itself.
bool writes_copy(const AdamWTensor& t) { return t.model_copy.defined() && t.model_copy.raw() != t.param.raw(); }

}  // namespace

void adamw_update(const KernelContext& ctx, Tensor param, const Tensor& grad, Tensor m, Tensor v, const AdamWStep& s,
                  Tensor model_copy) {
  const char* op = "adamw_update";
  require_cuda(ctx, op);
  check_dtype(op, "param", param, DType::F32);  // the f32 master; f64 is a CPU reference type
  check_same_shape(op, param, grad);
  check_same_shape(op, param, m);
  check_same_shape(op, param, v);
  check_dtype(op, "m", m, DType::F32);
  check_dtype(op, "v", v, DType::F32);
  if (model_copy.defined() && model_copy.numel() != param.numel())
    fail(ErrorKind::Shape, "adamw_update: model_copy ", model_copy.str(), " does not match the parameter ",
         param.str(), " (expected the same element count in f32, bf16 or f16)");
  check_on_device(op, {{"param", &param}, {"grad", &grad}, {"m", &m}, {"v", &v}, {"model_copy", &model_copy}});
  const int64_t n = param.numel();
  if (n == 0) return;
  const AdamWCoeffs k = coefficients(s);
  const unsigned blocks = unsigned(std::min<int64_t>(4096, blocks_for(n, kThreads)));
  float* p = static_cast<float*>(param.raw());
  // A model copy that is the master itself needs no second write.
  const bool copy = model_copy.defined() && model_copy.raw() != param.raw();
  dispatch_storage(grad.dtype(), op, [&](auto gtag) {
    using G = decltype(gtag);
    auto launch = [&](auto* out) {
      using C = std::remove_pointer_t<decltype(out)>;
      adamw_kernel<G, C><<<blocks, kThreads, 0, stream(ctx)>>>(p, static_cast<const G*>(grad.raw()),
                                                              static_cast<float*>(m.raw()),
                                                              static_cast<float*>(v.raw()), out, n, k);
    };
    if (!copy) {
      launch(static_cast<void*>(nullptr));
      return;
    }
    dispatch_storage(model_copy.dtype(), op, [&](auto ctag) {
      using C = decltype(ctag);
      launch(static_cast<C*>(model_copy.raw()));
    });
  });
  XR_CUDA_LAUNCH_CHECK();
}

void adamw_update_group(const KernelContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& s,
                        GroupTable& table) {
  const char* op = "adamw_update_group";
  require_cuda(ctx, op);
  if (tensors.empty()) return;
  // Checks, and the key of the list: pointers, lengths, decay, dtypes.
  const DType gdt = tensors.front().grad.dtype();
  DType cdt = DType::F32;
  bool any_copy = false;
  std::vector<uint64_t> key{uint64_t(reinterpret_cast<uintptr_t>(table.memory.raw()))};
  key.reserve(tensors.size() * 8 + 1);
  for (const AdamWTensor& t : tensors) {
    check_dtype(op, "param", t.param, DType::F32);
    check_same_shape(op, t.param, t.grad);
    check_same_shape(op, t.param, t.m);
    check_same_shape(op, t.param, t.v);
    check_dtype(op, "m", t.m, DType::F32);
    check_dtype(op, "v", t.v, DType::F32);
    check_dtype(op, "grad", t.grad, gdt);  // one G for the launch
    if (t.model_copy.defined() && t.model_copy.numel() != t.param.numel())
      fail(ErrorKind::Shape, op, ": model_copy ", t.model_copy.str(), " does not match the parameter ", t.param.str(),
           " (expected the same element count in f32, bf16 or f16)");
    if (writes_copy(t)) {
      if (any_copy && t.model_copy.dtype() != cdt)
        fail(ErrorKind::Shape, op, ": model copies of dtypes ", dtype_name(cdt), " and ",
             dtype_name(t.model_copy.dtype()), " in one group (expected one dtype)");
      cdt = t.model_copy.dtype();
      any_copy = true;
    }
    check_on_device(op, {{"param", &t.param}, {"grad", &t.grad}, {"m", &t.m}, {"v", &t.v}, {"model_copy", &t.model_copy}});
    for (const void* ptr : std::initializer_list<const void*>{t.param.raw(), t.grad.raw(), t.m.raw(), t.v.raw(),
                                                              writes_copy(t) ? t.model_copy.raw() : nullptr})
      key.push_back(uint64_t(reinterpret_cast<uintptr_t>(ptr)));
    key.push_back(uint64_t(t.param.numel()));
    key.push_back(t.decay ? 1 : 0);
    key.push_back(uint64_t(gdt) | (writes_copy(t) ? uint64_t(t.model_copy.dtype()) + 1 : 0) << 8);
  }
  if (key != table.key) {
    // The records, chunk by chunk, uploaded once (the copy waits: the host vector is freed after).
    check_on_device(op, {{"table", &table.memory}});
    const size_t gsize = dtype_size(gdt), csize = dtype_size(cdt);
    std::vector<AdamWChunk> recs;
    for (const AdamWTensor& t : tensors) {
      const bool copy = writes_copy(t);
      for (int64_t b = 0; b < t.param.numel(); b += kGroupChunk)
        recs.push_back({static_cast<float*>(t.param.raw()) + b, static_cast<const char*>(t.grad.raw()) + b * gsize,
                        static_cast<float*>(t.m.raw()) + b, static_cast<float*>(t.v.raw()) + b,
                        copy ? static_cast<void*>(static_cast<char*>(t.model_copy.raw()) + b * csize) : nullptr,
                        int32_t(std::min(kGroupChunk, t.param.numel() - b)), t.decay ? 1 : 0});
    }
    const size_t bytes = recs.size() * sizeof(AdamWChunk);
    if (bytes > table.memory.bytes())
      fail(ErrorKind::Memory, op, ": ", recs.size(), " chunks need ", bytes, " bytes of table but it has ",
           table.memory.bytes(), " (sized by group_table_words for fewer tensors or elements)");
    if (recs.size() > size_t(INT_MAX)) fail(ErrorKind::Shape, op, ": ", recs.size(), " chunks exceed one grid");
    table.key.clear();  // a failed upload leaves no stale key
    if (bytes) copy_bytes(table.memory.raw(), Device::CUDA, recs.data(), Device::CPU, bytes, ctx.cuda_stream, true);
    table.key = std::move(key);
    table.chunks = int64_t(recs.size());
  }
  if (table.chunks == 0) return;
  const AdamWCoeffs k = coefficients(s);
  const auto* chunks = static_cast<const AdamWChunk*>(table.memory.raw());
  dispatch_storage(gdt, op, [&](auto gtag) {
    using G = decltype(gtag);
    if (!any_copy) {
      adamw_group_kernel<G, void><<<unsigned(table.chunks), kThreads, 0, stream(ctx)>>>(chunks, k);
      return;
    }
    dispatch_storage(cdt, op, [&](auto ctag) {
      using C = decltype(ctag);
      adamw_group_kernel<G, C><<<unsigned(table.chunks), kThreads, 0, stream(ctx)>>>(chunks, k);
    });
  });
  XR_CUDA_LAUNCH_CHECK();
}

}  // namespace xirang::cuda
