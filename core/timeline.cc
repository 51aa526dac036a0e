#include "core/timeline.h"

#include "core/error.h"

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
      "tied_all_reduce", "cp_all_gather", "cp_reduce_scatter"};
  return names[int(k)];
}

bool op_kind_is_comm(OpKind k) { return int(k) >= int(OpKind::TpAllReduce); }

Timeline::Timeline() = default;
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
  if (!events_) {
    own_events_ = std::make_unique<DeviceEvents>();
    events_ = own_events_.get();
  }
  if (op_kinds_.size() == device_ops_) {  // grows during the first profiled step only
    op_events_.push_back(events_->take());
    op_events_.push_back(events_->take());
    op_kinds_.push_back(OpKind::Matmul);
  }
  events_->record(op_events_[2 * device_ops_], stream);
}

void Timeline::end_device_op(void* stream, OpKind k) {
  events_->record(op_events_[2 * device_ops_ + 1], stream);
  op_kinds_[device_ops_++] = k;
}

OpTimes Timeline::take_ops() {
  for (auto& [k, ms] : later_) add_op_ms(k, ms());
  later_.clear();
  if (device_ops_ > 0) events_->wait(op_events_[2 * device_ops_ - 1]);  // profiling's one host wait per step
  for (size_t i = 0; i < device_ops_; ++i) add_op_ms(op_kinds_[i], events_->ms(op_events_[2 * i], op_events_[2 * i + 1]));
  device_ops_ = 0;
  OpTimes out = ops_;
  ops_ = OpTimes{};
  return out;
}

}  // namespace xirang
