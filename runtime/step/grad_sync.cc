#include "runtime/step/grad_sync.h"

#include <algorithm>
#include <cmath>

#include "core/clock.h"
#include "core/device_memory.h"
#include "core/error.h"
#include "kernels/elementwise.h"

namespace xirang {

namespace {
// The bytes of parameters a bucket's ZeRO gather delivers.
int64_t gather_bytes(const GradSync::Bucket& b, size_t element_size) { return (b.end - b.begin) * int64_t(element_size); }
}  // namespace

GradSync::GradSync(std::vector<Parameter>& params, Communicator& dp, Communicator* tp, Communicator* pp,
                   GradSyncOptions opts, Communicator* dp_host)
    : params_(params), dp_(dp), dp_host_(dp_host ? dp_host : &dp), tp_(tp), pp_(pp), opts_(opts) {
  XR_CHECK(!params.empty(), "GradSync without parameters");
  const DType dt = params.front().grad.dtype();
  const size_t es = dtype_size(dt);
  const size_t pes = dtype_size(params.front().value.dtype());  // 16-bit parameters have f32 gradients
  char* pbase = static_cast<char*>(params.front().value.raw());
  char* gbase = static_cast<char*>(params.front().grad.raw());
  for (auto& p : params) {
    const int64_t po = (static_cast<char*>(p.value.raw()) - pbase) / int64_t(pes);
    const int64_t go = (static_cast<char*>(p.grad.raw()) - gbase) / int64_t(es);
    XR_CHECK(po == go && p.grad.dtype() == dt, "parameter ", p.name, " is not laid out like its gradient");
    XR_CHECK(offset_.empty() || po >= offset_.back(), "parameters are not in arena order");
    offset_.push_back(po);
  }
  // The flat span ends at the last parameter's aligned allocation end, so
  // buckets tile the buffers without gaps (padding elements are zero and stay zero).
  const int64_t align = int64_t(Arena::kAlignment / es);
  const int64_t total = (offset_.back() + params.back().value.numel() + align - 1) / align * align;
  flat_params_ = Tensor(pbase, {total}, params.front().value.dtype(), params.front().value.device());
  flat_grads_ = Tensor(gbase, {total}, dt, params.front().grad.device());

  // Buckets from the end of the buffer (reverse layer order).
  const int64_t bucket_elems = std::max<int64_t>(1, int64_t(opts_.bucket_mb * 1024 * 1024 / double(es)));
  bucket_of_.assign(params.size(), -1);
  int64_t end = total;
  Bucket cur;
  for (int i = int(params.size()) - 1; i >= 0; --i) {
    cur.params.push_back(i);
    cur.begin = offset_[size_t(i)];
    if (end - cur.begin >= bucket_elems || i == 0) {
      cur.end = end;
      for (int q : cur.params) bucket_of_[size_t(q)] = int(buckets_.size());
      buckets_.push_back(cur);
      end = cur.begin;
      cur = Bucket();
    }
  }
  int64_t shard_off = 0;
  for (auto& b : buckets_) {
    auto [c0, c1] = split_range(b.end - b.begin, dp_.size(), dp_.rank());
    b.chunk_begin = b.begin + c0;
    b.chunk_end = b.begin + c1;
    b.shard_offset = shard_off;
    shard_off += c1 - c0;
  }
  if (opts_.zero) shard_elems_ = shard_off;
}

GradSync::~GradSync() = default;

void GradSync::layout(Arena& shard) {
  if (opts_.zero) shard_grads_ = shard.alloc({shard_elems_}, flat_grads_.dtype(), "ZeRO gradient shard");
  norm_sum_ = shard.alloc({1}, DType::F64, "gradient norm sum");
  norm_grads_.clear();  // chosen again from the optimizer's new segments
  // Room for every segment; grad_norm counts a subset of them.
  int64_t count = 0, elements = 0;
  for (const OptimizerSegment& seg : optimizer_segments()) {
    ++count;
    elements += seg.param.numel();
  }
  norm_table_ = GroupTable(shard.alloc({group_table_words(count, elements)}, DType::U32, "gradient norm chunk table"));
}

std::vector<OptimizerSegment> GradSync::optimizer_segments() const {
  std::vector<OptimizerSegment> segs;
  if (!opts_.zero) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const Parameter& p = params_[i];
      segs.push_back({p.value.flat(), p.grad.flat(), p.decay, p.shard.replicated(), p.tied_copy, int(i), 0});
    }
    return segs;
  }
  // This rank's chunk of each bucket, cut at parameter boundaries (decay differs per parameter).
  for (const Bucket& b : buckets_) {
    for (int i : b.params) {
      const int64_t p0 = offset_[size_t(i)], p1 = p0 + params_[size_t(i)].value.numel();
      const int64_t s0 = std::max(p0, b.chunk_begin), s1 = std::min(p1, b.chunk_end);
      if (s0 >= s1) continue;
      Tensor g = shard_grads_.defined()
                     ? shard_grads_.flat_range(s0 - b.chunk_begin + b.shard_offset, s1 - b.chunk_begin + b.shard_offset)
                     : Tensor(nullptr, {s1 - s0}, flat_grads_.dtype());
      const Parameter& p = params_[size_t(i)];
      segs.push_back({flat_params_.flat_range(s0, s1), g, p.decay, p.shard.replicated(), p.tied_copy, i, s0 - p0});
    }
  }
  return segs;
}

void GradSync::begin_step() {
  for (auto& b : buckets_) {
    b.pending = int(b.params.size());
    b.work.reset();
  }
  comm_ms_ = device_exposed_ms_ = 0;
  first_launch_ = 0;
  settled_ = false;
}

void GradSync::launch(Bucket& b) {
  // Read before the part opens: the step's exposed time lies inside [first launch, last completion].
  b.launched_at = now_seconds();
  if (first_launch_ == 0) first_launch_ = b.launched_at;
  StepClock::Scope part(clock_, StepPart::DpCommExposed);  // the launch holds the caller
  Tensor grads = flat_grads_.flat_range(b.begin, b.end);
  if (opts_.zero)
    b.work = dp_.reduce_scatter_async(
        grads, shard_grads_.flat_range(b.shard_offset, b.shard_offset + (b.chunk_end - b.chunk_begin)), ReduceOp::Sum);
  else
    b.work = dp_.all_reduce_async(grads, ReduceOp::Sum);
}

void GradSync::open_wait(StreamWait& w) {
  XR_CHECK(clock_, "GradSync: joins on a device stream need the step clock's device events");
  DeviceEvents& ev = clock_->device_events();
  if (w.before < 0) {
    w.before = ev.take();
    w.after = ev.take();
  }
  ev.record(w.before, stream_);
}

void GradSync::close_wait(StreamWait& w) {
  clock_->device_events().record(w.after, stream_);
  w.pending = true;
}

void GradSync::read_wait(StreamWait& w) {
  if (!w.pending) return;
  DeviceEvents& ev = clock_->device_events();
  if (!ev.done(w.after)) return;
  device_exposed_ms_ += ev.ms(w.before, w.after);
  w.pending = false;
}

double GradSync::device_exposed_ms() {
  read_wait(bucket_wait_);  // the stream has passed the joins (grad_norm synchronized it)
  return device_exposed_ms_;
}

void GradSync::record(const WorkPtr& w, OpKind kind, double t0, int bucket, int64_t bytes) {
  if (!tl_ || dp_.size() == 1) return;
  const double ms = w->duration_ms();
  if (tl_->profiling()) tl_->add_op_ms(kind, ms);
  add_span(tl_, op_kind_name(kind), Track::DpComm, t0, t0 + ms / 1e3, -1, -1, bucket, bytes);
}

void GradSync::layer_done(int layer) {
  if (!opts_.overlap) return;
  // Buckets complete in order during backward; launch each as soon as it is
  // whole. From the last parameter: a layer that completes several buckets
  // (one larger than bucket_mb) launches them in bucket order, as finish() does.
  for (size_t i = params_.size(); i-- > 0;) {
    if (params_[i].layer != layer) continue;
    Bucket& b = buckets_[size_t(bucket_of_[i])];
    if (--b.pending == 0) launch(b);
  }
}

void GradSync::finish(void* stream) {
  stream_ = stream;
  for (auto& b : buckets_) {
    if (!b.work) launch(b);
  }
  // On the host each join waits; on a device the stream waits for every
  // bucket and the host goes on (settle() waits once, with the timeout).
  {
    StepClock::Scope part(clock_, StepPart::DpCommExposed, {tl_, "dp_wait"});
    if (stream) open_wait(bucket_wait_);
    for (auto& b : buckets_) b.work->join(stream);
    if (stream) close_wait(bucket_wait_);
  }
  joined_at_ = now_seconds();  // after the part closed: the communication lasts at least this long
  if (!stream) settle();
}

void GradSync::settle() {
  if (settled_) return;
  // On the host finish() waited.
  StepClock::Scope part(stream_ ? clock_ : nullptr, StepPart::DpCommExposed, {stream_ ? tl_ : nullptr, "dp_wait"});
  // A bucket's completion is its launch plus its duration; the span to the
  // last one is the communication time (operations overlap one another).
  // On the host the communication lasts at least until the waits for it
  // returned: the step was held that long, so exposed_ms <= comm_ms.
  double last_done = stream_ ? first_launch_ : std::max(first_launch_, joined_at_);
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    b.work->wait();
    last_done = std::max(last_done, b.launched_at + b.work->duration_ms() / 1e3);
    record(b.work, opts_.zero ? OpKind::DpReduceScatter : OpKind::DpAllReduce, b.launched_at, int(i),
           (b.end - b.begin) * int64_t(dtype_size(flat_grads_.dtype())));
  }
  comm_ms_ += (last_done - first_launch_) * 1e3;
  // A device's ZeRO gather of the previous step completed before these buckets (same channel).
  if (!gathers_.empty()) {
    double end = gather_start_;
    for (size_t i = 0; i < gathers_.size(); ++i) {
      end = std::max(end, gather_start_ + gathers_[i]->duration_ms() / 1e3);
      record(gathers_[i], OpKind::DpAllGather, gather_start_, int(i), gather_bytes(buckets_[i], dtype_size(flat_params_.dtype())));
    }
    comm_ms_ += (end - gather_start_) * 1e3;
    gathers_.clear();
  }
  settled_ = true;
}

void GradSync::gather_parameters() {
  if (!opts_.zero) return;
  gather_start_ = now_seconds();  // before the part opens, as a launch's time
  // On the host a blocking gather: its wait is drawn.
  StepClock::Scope part(clock_, StepPart::DpCommExposed, {stream_ ? nullptr : tl_, "dp_wait"});
  gathers_.clear();
  for (auto& b : buckets_)
    gathers_.push_back(dp_.all_gather_async(flat_params_.flat_range(b.chunk_begin, b.chunk_end),
                                            flat_params_.flat_range(b.begin, b.end)));
  // On a device the next step's kernels wait for the gathers on the stream,
  // and their time is counted when the next step settles.
  if (stream_) {
    read_wait(gather_wait_);  // the previous step's: the stream passed it before this step's grad_norm returned
    open_wait(gather_wait_);
  }
  for (auto& w : gathers_) w->join(stream_);
  if (stream_) close_wait(gather_wait_);
  if (stream_) return;
  for (size_t i = 0; i < gathers_.size(); ++i)
    record(gathers_[i], OpKind::DpAllGather, gather_start_, int(i), gather_bytes(buckets_[i], dtype_size(flat_params_.dtype())));
  part.end();
  comm_ms_ += (now_seconds() - gather_start_) * 1e3;  // a blocking gather: all of it exposed
  gathers_.clear();
}

double GradSync::grad_norm(const KernelContext& ctx, const AdamW& opt) {
  const bool tp_split = tp_ && tp_->size() > 1;
  // The squares of the counted segments add up on the device; the host
  // reads the sum once, after the timed wait for the buckets (settle).
  if (norm_grads_.empty())
    for (const auto& seg : opt.segments())
      if (!(tp_split && seg.tp_replicated && tp_->rank() != 0) && !seg.tied_copy) norm_grads_.push_back(seg.grad);
  sum_squares_group(ctx, norm_sum_, norm_grads_, norm_table_);
  settle();
  double s = 0;
  {
    // On a device the read waits for the stream to run the step's queued passes: their time is the device's.
    StepClock::Scope wait(norm_sum_.device() != Device::CPU ? clock_ : nullptr, StepPart::DeviceWait);
    copy_bytes(&s, Device::CPU, norm_sum_.raw(), norm_sum_.device(), sizeof(double), ctx.cuda_stream, true);
  }
  if (tp_split) s = tp_->all_reduce_sum(s);
  if (pp_ && pp_->size() > 1) s = pp_->all_reduce_sum(s);
  if (opts_.zero) s = dp_host_->all_reduce_sum(s);
  return std::sqrt(s);
}

}  // namespace xirang
