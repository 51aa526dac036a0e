// runtime/data/loader.h: the training data loader of one rank: it reads this
// rank's microbatches on background threads, ahead of the trainer, so a step
// never waits for storage.
//
// The loader owns the order in which this rank consumes microbatches, the
// threads that read them, and the bounded queue of ready ones. What goes into
// a microbatch is SequenceSampler's business: microbatch (step, mb) holds, for
// b in [0, B), global sample
//
//   g = step * GB + dp_rank * (GB / dp) + mb * B + b
//
// filled exactly as SequenceSampler::fill fills it (T tokens from the
// sample's start, targets shifted by one), or, with spec.rows (a cp rank's
// chunks), only those rows: (B, R) with R = rows.rows(T), read alone; every
// cp rank of a dp rank reads the same samples. Microbatches come out in
// consumption order: (step, 0), ..., (step, m - 1), (step + 1, 0), ...
//
//   LoaderSpec spec{.seq_len = T, .seed = seed, .micro_batch = B, .global_batch = GB,
//                   .dp = dp, .dp_rank = rank, .microbatches = m,
//                   .need_tokens = first_stage, .need_targets = last_stage,
//                   .first_step = resume_step};
//   PrefetchLoader loader(train_data, spec, LoaderOptions{});
//   for (int mb = 0; mb < m; ++mb) loader.next(step, mb, tokens, targets);  // (B, T) each, either may be null
//   double blocked_ms = loader.take_wait_ms();  // time next() waited since the last call
//
// Device-ready microbatches: with spec.device a GPU, the tensor form of
// next() fills (B, T) int32 tensors in device memory, so that the pipeline
// executor only schedules. Each microbatch goes through the next of
// spec.staging_buffers pinned host buffers (HostStaging) and is uploaded
// asynchronously on the caller's stream; a buffer is refilled only once its
// previous upload has been read.
//
//   loader.next(step, mb, slot_tokens, slot_targets, stream);  // either tensor may be undefined
//
// Checkpoints: the order is a pure function of (seed, step) (the epoch
// permutation depends on (seed, epoch) only), so the loader's whole state is
// the next (step, mb) it will hand out, and a run resumes exactly by
// constructing a loader with first_step = the step to run next. Nothing else
// needs saving.
//
// Prefetching: `threads` workers claim sequence numbers in order and fill the
// ring slot seq % prefetch_max; next() hands slots out strictly in sequence
// order, whichever worker finished first. Workers never claim more than
// depth() microbatches ahead of the consumer. The depth adapts:
//
//   want  = clamp(ceil(mean_load_ms / mean_consume_interval_ms) + 1, prefetch_min, prefetch_max)
//
// where mean_load_ms is a moving average of the time one worker takes to
// read a microbatch and mean_consume_interval_ms one of the time the caller
// spends between a next() returning and the following call (its compute
// time, waits excluded). ceil(load / interval) microbatches are consumed
// while one loads, so that many must be in flight, plus one ready. The depth
// rises to `want` at once; a next() that had to wait raises it by one more
// (the averages lag a change in speed); it falls by one only after 16
// consecutive calls without a wait that all want less, so a short burst
// does not throw away read-ahead. The depth starts at prefetch_min.
//
// Buffers for prefetch_max microbatches are allocated at construction;
// nothing is allocated in steady state. Not thread-safe: one thread calls
// next() (the workers are internal).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/device_memory.h"
#include "core/tensor.h"
#include "runtime/data/dataset.h"
#include "runtime/data/sampler.h"

namespace xirang {

// What this rank consumes: the batch geometry and where to start.
struct LoaderSpec {
  int seq_len = 0;             // T
  uint64_t seed = 0;           // epoch permutations are a function of (seed, epoch)
  int micro_batch = 1;         // B
  int64_t global_batch = 1;    // GB, a multiple of dp * B
  int dp = 1;                  // data-parallel size
  int dp_rank = 0;             // this rank's part of the global batch
  int microbatches = 1;        // m = GB / (dp * B)
  SampleRows rows;             // the rows of each sample this rank reads (a cp rank's); default: all T
  bool need_tokens = true;     // first pipeline stage
  bool need_targets = true;    // last pipeline stage
  int64_t first_step = 0;      // the step to produce first (resume)
  Device device = Device::CPU; // where the tensor form of next() delivers
  int staging_buffers = 1;     // a GPU's uploads in flight at once (one per activation slot never waits)
};

struct LoaderOptions {
  bool enabled = true;         // false: next() reads on the caller's thread
  int prefetch_min = 2;        // depth bounds, microbatches read ahead
  int prefetch_max = 8;        // also the number of buffers allocated
  int threads = 2;             // worker threads
  double read_delay_ms = 0;    // fault injection: each sample read sleeps this long (slow storage)
  int64_t fail_after = -1;     // fault injection: microbatches with sequence number >= this (counted
                               // from first_step, 0-based) fail to read with a Data error; -1: never
};

struct LoaderStats {
  int64_t loaded = 0;                     // microbatches read so far (workers or synchronous)
  int64_t waits = 0;                      // next() calls that blocked (every call when disabled)
  double wait_ms = 0;                     // total blocked time since construction
  double mean_load_ms = 0;                // moving average, one microbatch's read
  double mean_consume_interval_ms = 0;    // moving average, caller's time between next() calls
  int depth = 0;                          // current read-ahead target
};

class PrefetchLoader {
 public:
  // Starts the workers at once, so the first microbatches load while the
  // caller sets up. Throws a Config error for inconsistent spec/options and
  // a Data error when the dataset holds no sample of seq_len + 1 tokens.
  PrefetchLoader(const TokenDataset& data, const LoaderSpec& spec, const LoaderOptions& opts);
  // Stops and joins the workers without waiting for reads in progress to
  // finish their injected delays.
  ~PrefetchLoader();
  PrefetchLoader(const PrefetchLoader&) = delete;
  PrefetchLoader& operator=(const PrefetchLoader&) = delete;

  // Rows of each sample this rank holds (T, or T / cp under context parallelism).
  int64_t rows() const { return spec_.rows.rows(spec_.seq_len); }
  // Copies microbatch (step, mb), which must be the next one in order
  // (Internal error otherwise), into tokens and targets ((B, rows()) each; either
  // may be null, and must be null when the spec does not need it). Blocks
  // until it is read. A read error on a worker is rethrown here, as the same
  // exception, when its microbatch comes up (and again on every later call).
  void next(int64_t step, int mb, int32_t* tokens, int32_t* targets);
  // The same into (B, rows()) int32 tensors on spec.device (either undefined when
  // not needed); on a GPU the upload is queued on `stream` (a cudaStream_t)
  // and next() returns without waiting for it.
  void next(int64_t step, int mb, const Tensor& tokens, const Tensor& targets, void* stream);
  // Time next() spent blocked since the last call, in ms; resets it.
  double take_wait_ms();

  int depth() const;
  LoaderStats stats() const;
  // The microbatch next() expects: the loader's checkpoint state.
  int64_t next_step() const { return spec_.first_step + next_take_ / spec_.microbatches; }
  int next_microbatch() const { return int(next_take_ % spec_.microbatches); }

 private:
  enum class SlotState { Free, Loading, Ready, Failed };
  struct Slot {
    SlotState state = SlotState::Free;
    int64_t seq = -1;              // the sequence number it holds or is loading
    std::vector<int32_t> tokens;   // (B, rows()) when need_tokens, else empty
    std::vector<int32_t> targets;  // (B, rows()) when need_targets, else empty
    std::exception_ptr error;      // set when Failed
  };
  // A sampler (not thread-safe) and one sample's scratch for what the spec does not need.
  struct Reader {
    std::unique_ptr<SequenceSampler> sampler;
    std::vector<int32_t> scratch_tokens, scratch_targets;  // (rows())
  };

  // next() without prefetching: the read is the wait.
  void next_unbuffered(int32_t* tokens, int32_t* targets, double entry);
  // Reads microbatch `seq` into tokens/targets (null: not needed). Returns
  // false when the loader stopped during an injected delay.
  bool load(Reader& r, int64_t seq, int32_t* tokens, int32_t* targets, bool interruptible);
  void worker(int w);
  void retune(bool waited);  // mu_ held
  void stop_workers();

  const TokenDataset& data_;
  LoaderSpec spec_;
  LoaderOptions opts_;
  int64_t per_rank_;  // GB / dp
  std::vector<Reader> readers_;  // one per worker, or one for the synchronous path
  std::vector<Slot> slots_;      // ring of prefetch_max, slot of seq = seq % prefetch_max
  std::vector<std::thread> threads_;
  std::vector<HostStaging> staging_;  // spec.device a GPU: [tokens | targets] of a microbatch, a ring
  size_t next_staging_ = 0;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // workers: a slot or depth opened up, or stop
  std::condition_variable ready_cv_;  // consumer: a slot became Ready or Failed
  std::condition_variable stop_cv_;   // injected delays: stop
  bool stop_ = false;
  bool broken_ = false;       // a read failed: claim nothing more
  int64_t next_claim_ = 0;    // next sequence number a worker takes
  int64_t next_take_ = 0;     // next sequence number next() hands out (written by the consumer only)
  int depth_ = 0;
  int calm_ = 0;              // consecutive wait-free calls that wanted a smaller depth
  double last_return_ = -1;   // when next() last returned (seconds), -1 before the first
  int64_t intervals_ = 0;     // consume intervals measured
  LoaderStats stats_;
  double wait_pending_ms_ = 0;  // for take_wait_ms()
};

}  // namespace xirang
