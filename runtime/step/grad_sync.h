// runtime/step/grad_sync.h: data-parallel gradient reduction in buckets, and the
// ZeRO-1 sharding of the optimizer.
//
// The gradients live in one flat arena, in the parameters' order (forward
// order). Buckets tile that buffer from its end: the last layers' gradients
// are final first during backward, so bucket 0 holds the final LayerNorm and
// the last blocks, and the embeddings close the last bucket. A bucket is
// reduced over the dp group the moment every parameter in it is final
// (layer_done() from the model's backward hook during the last microbatch),
// on its own communication channel, while the backward pass goes on. The
// optimizer waits in finish() only for what is still in flight.
//
// zero = 0: each bucket is all-reduced; every rank updates every parameter.
// zero = 1: each bucket is reduce-scattered; rank r receives the summed
// gradients of its chunk of every bucket (split_range), updates only those
// elements (so optimizer state is 1/dp), and gather_parameters() all-gathers
// the updated chunks back into every rank's parameters.
//
//   GradSync sync(model.parameters(), grid.dp_grads(), {.bucket_mb = 25, .overlap = true, .zero = false});
//   sync.layout(shard_arena);           // ZeRO shard gradients (measuring, then real)
//   opt.set_segments(sync.optimizer_segments());
//   sync.begin_step();
//   ... last microbatch: model backward calls sync.layer_done(l) ...
//   sync.finish(stream);                // every reduction joined (null stream: waited for)
//   opt.step(...); sync.gather_parameters();
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/arena.h"
#include "kernels/group_table.h"
#include "models/parameter.h"
#include "runtime/step/optimizer.h"

namespace xirang {

struct GradSyncOptions {
  double bucket_mb = 25;
  bool overlap = true;  // launch buckets during backward (else all after it)
  bool zero = false;    // ZeRO-1
};

class GradSync {
 public:
  // `params` must be carved contiguously and in order from one parameter
  // arena and one gradient arena with the same layout (ModelChunk::layout_parameters).
  // `tp` and `pp` (may be null) are the tensor- and pipeline-parallel groups, for the gradient norm;
  // `dp_host` (null: dp itself) carries the norm's host scalar over dp when
  // `dp` moves device tensors (NCCL).
  GradSync(std::vector<Parameter>& params, Communicator& dp, Communicator* tp, Communicator* pp,
           GradSyncOptions opts, Communicator* dp_host = nullptr);
  ~GradSync();

  // Carves the ZeRO shard-gradient buffer (nothing without ZeRO), the
  // norm's sum and the norm's chunk table (sized for every segment).
  void layout(Arena& shard);
  // Segments for the optimizer: whole parameters, or this rank's shard pieces.
  std::vector<OptimizerSegment> optimizer_segments() const;

  // Where the reductions go on the timeline (spans on its DpComm track,
  // per-op times); null: nowhere. Set before begin_step().
  void set_timeline(Timeline* tl) { tl_ = tl; }
  // The step clock whose DpCommExposed part launches and waits are (and
  // DeviceWait the norm's wait for a device); null: none.
  void set_clock(StepClock* clock) { clock_ = clock; }
  void begin_step();
  // The gradients of `layer` (-1 embeddings, n_layer final norm) are final.
  void layer_done(int layer);
  // Launches what is left and joins every bucket to `stream`: on the host
  // (null) that is a wait for each; on a device the compute stream waits for
  // them and the host goes on, so the norm's kernels queue at once.
  void finish(void* stream = nullptr);
  // ZeRO: all-gathers updated parameter chunks (no-op without ZeRO); on a
  // device joined to finish()'s stream without a host wait.
  void gather_parameters();
  // Global gradient norm: the sum of squares of this rank's segments
  // (tensor-parallel replicas and the last stage's tied token table counted
  // once), summed over tp and pp, and over dp when sharded. The squares are
  // summed on the device, all segments in one grouped reduction
  // (sum_squares_group); the host waits once per step, here: for the
  // buckets, with the channel's timeout, then for the sum.
  double grad_norm(const KernelContext& ctx, const AdamW& opt);

  // Time dp communication was in flight this step (from the first launch to
  // the last completion, per phase: gradients, then ZeRO parameter gather).
  // On the host it lasts at least until the waits for it returned.
  double comm_ms() const { return comm_ms_; }
  // The time the step was held by dp communication on a device: the time
  // the compute stream waited for the buckets after its backward work (a
  // pair of timing events around finish()'s joins, read once the stream has
  // passed them: after grad_norm), and for the previous step's ZeRO gather,
  // which completes behind the host and is counted in the next step like
  // its communication time. On the host it is the clock's DpCommExposed.
  double device_exposed_ms();
  int num_buckets() const { return int(buckets_.size()); }
  int64_t shard_elements() const { return shard_elems_; }

  struct Bucket {
    int64_t begin = 0, end = 0;        // element range of the flat buffers
    int64_t chunk_begin = 0, chunk_end = 0;  // this rank's chunk (ZeRO)
    int64_t shard_offset = 0;          // where the chunk sits in the shard buffer
    std::vector<int> params;           // parameter indices in the bucket
    int pending = 0;                   // parameters not yet final this step
    WorkPtr work;
    double launched_at = 0;            // seconds, steady clock
  };

 private:
  void launch(Bucket& b);
  // Puts the completed operation `w`, submitted at `t0`, on the timeline.
  void record(const WorkPtr& w, OpKind kind, double t0, int bucket, int64_t bytes);
  // Waits on the host for every bucket (the step's timed wait) and adds up
  // the communication time; once per step.
  void settle();

  std::vector<Parameter>& params_;
  Communicator& dp_;
  Communicator* dp_host_;
  Communicator* tp_;
  Communicator* pp_;
  GradSyncOptions opts_;
  Tensor flat_params_, flat_grads_;  // 1-D views over the arenas
  std::vector<int64_t> offset_;      // element offset of each parameter
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;       // parameter -> bucket
  Tensor shard_grads_;               // (shard_elems_) ZeRO
  int64_t shard_elems_ = 0;
  double comm_ms_ = 0;
  double device_exposed_ms_ = 0;  // the compute stream's waits, read from timing events
  double first_launch_ = 0;  // seconds; 0 before the first launch of the step
  double joined_at_ = 0;     // seconds; when finish()'s host waits returned (null stream)
  void* stream_ = nullptr;   // finish()'s stream: null on the host
  bool settled_ = false;
  Tensor norm_sum_;          // (1) F64 sum of squares, on the gradients' device
  GroupTable norm_table_;    // sum_squares_group's chunk table
  std::vector<Tensor> norm_grads_;  // the gradients the norm counts (fixed once the optimizer is laid out)
  std::vector<WorkPtr> gathers_;  // ZeRO gathers not yet counted (device)
  double gather_start_ = 0;
  // The compute stream's wait at a join on a device: a pair of the step
  // clock's timing events around it; the time between them is the stream's
  // wait beyond its own work.
  struct StreamWait {
    int before = -1, after = -1;
    bool pending = false;  // recorded and not yet read
  };
  void open_wait(StreamWait& w);
  void close_wait(StreamWait& w);
  // Adds a completed pending wait to device_exposed_ms_.
  void read_wait(StreamWait& w);
  StreamWait bucket_wait_, gather_wait_;
  Timeline* tl_ = nullptr;
  StepClock* clock_ = nullptr;
};

}  // namespace xirang
