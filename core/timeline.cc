#include "core/timeline.h"

#include "core/error.h"
#ifdef XIRANG_HAVE_CUDA
#include "core/cuda_stream.h"
#endif

namespace xirang {

const char* track_name(Track t) {
  switch (t) {
    case Track::Main: return "compute";
    case Track::DpComm: return "dp reductions";
    case Track::PipeSend: return "pp sends";
    case Track::PipeRecv: return "pp receives";
    case Track::Checkpoint: return "checkpoint writer";
    case Track::Device: return "device stream";
  }
  return "?";
}

const char* op_kind_name(OpKind k) {
  static const char* const names[kOpKindCount] = {
      "matmul",         "attention",      "norm",          "loss",          "embedding",
      "elementwise",    "optimizer",      "tp_all_reduce", "tp_all_gather", "tp_reduce_scatter",
      "dp_all_reduce",  "dp_reduce_scatter", "dp_all_gather", "pp_send",    "pp_recv",
      "tied_all_reduce"};
  return names[int(k)];
}

bool op_kind_is_comm(OpKind k) { return int(k) >= int(OpKind::TpAllReduce); }

#ifdef XIRANG_HAVE_CUDA
struct Timeline::DeviceOps {
  std::vector<CudaEvent> pool;  // start and end of op i at 2i, 2i + 1
  std::vector<OpKind> kinds;
  size_t used = 0;
};
#else
struct Timeline::DeviceOps {};
#endif

Timeline::Timeline() : dev_(std::make_unique<DeviceOps>()) {}
Timeline::~Timeline() = default;

void Timeline::add_span(const Span& s) {
  std::lock_guard<std::mutex> lock(mu_);
  spans_.push_back(s);
}

std::vector<Span> Timeline::take_spans() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Span> out;
  out.swap(spans_);
  return out;
}

void Timeline::add_op_ms(OpKind k, double ms) {
  ops_.ms[size_t(k)] += ms;
  ++ops_.calls[size_t(k)];
}

void Timeline::add_op_later(OpKind k, std::function<double()> ms) {
  if (profiling_) later_.emplace_back(k, std::move(ms));
}

void Timeline::begin_device_op(void* stream) {
#ifdef XIRANG_HAVE_CUDA
  DeviceOps& d = *dev_;
  if (d.pool.size() < 2 * (d.used + 1)) {  // grows during the first profiled step only
    d.pool.emplace_back(EventTiming::Enabled);
    d.pool.emplace_back(EventTiming::Enabled);
    d.kinds.push_back(OpKind::Matmul);
  }
  d.pool[2 * d.used].record(static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  XR_CHECK(false, "a device op timed in a build without CUDA");
#endif
}

void Timeline::end_device_op(void* stream, OpKind k) {
#ifdef XIRANG_HAVE_CUDA
  DeviceOps& d = *dev_;
  d.pool[2 * d.used + 1].record(static_cast<cudaStream_t>(stream));
  d.kinds[d.used++] = k;
#else
  (void)stream;
  (void)k;
#endif
}

OpTimes Timeline::take_ops() {
  for (auto& [k, ms] : later_) add_op_ms(k, ms());
  later_.clear();
#ifdef XIRANG_HAVE_CUDA
  DeviceOps& d = *dev_;
  if (d.used > 0) d.pool[2 * d.used - 1].synchronize();  // profiling's one host wait per step
  for (size_t i = 0; i < d.used; ++i) add_op_ms(d.kinds[i], elapsed_ms(d.pool[2 * i], d.pool[2 * i + 1]));
  d.used = 0;
#endif
  OpTimes out = ops_;
  ops_ = OpTimes{};
  return out;
}

}  // namespace xirang
