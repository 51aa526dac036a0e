#include "runtime/checkpoint/checkpointer.h"

#include <cstdio>
#include <filesystem>
#include <optional>

#include "core/device_memory.h"
#include "core/error.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/model_layout.h"
#include "runtime/resilience/guards.h"

namespace xirang {

Checkpointer::Checkpointer(const Config& cfg, ProcessGrid& grid, TrainingState state, Device device,
                           SaveFaults faults, bool print)
    : cfg_(cfg), grid_(grid), state_(state), device_(device), faults_(faults), print_(print) {}

Checkpointer::~Checkpointer() {
  // A save still in flight is completed only by finish(); here the thread
  // is only joined so that it never outlives what it writes from.
  if (saver_.joinable()) saver_.join();
}

bool Checkpointer::uses_snapshot() const {
  return !cfg_.checkpoint.dir.empty() && (cfg_.checkpoint.async || device_ != Device::CPU);
}

void Checkpointer::allocate_snapshot(size_t bytes) { snapshot_ = Arena("checkpoint snapshot", bytes); }

bool Checkpointer::due(int steps_done, int last) const {
  return !cfg_.checkpoint.dir.empty() &&
         ((cfg_.checkpoint.every > 0 && steps_done % cfg_.checkpoint.every == 0) || steps_done == last);
}

// ---------------------------------------------------------------------------
// Saving

std::vector<Checkpointer::SaveEntry> Checkpointer::entries_to_save() const {
  // Each element once: data-parallel replicas and the last stage's copy of
  // the tied token table leave it to their twin.
  std::vector<SaveEntry> todo;
  // cp ranks are replicas too (parameters are replicated over dp x cp).
  const bool replica_writer = grid_.coords().dp == 0 && grid_.coords().cp == 0;
  for (const Parameter& p : state_.params)
    if (replica_writer && !p.tied_copy) todo.push_back({"params", p.name, p.shard, 0, p.value.numel(), p.value});
  // The optimizer's state segment by segment (each segment's groups together).
  const bool zero = cfg_.parallel.zero == 1;
  const OptimizerState& opt = state_.optimizer;
  for (const OptimizerStateGroup& g : opt.groups)
    XR_CHECK(g.slices.size() == opt.segments(), "optimizer state group '", g.name, "' has ", g.slices.size(),
             " segments, the first group ", opt.segments());
  for (size_t i = 0; i < opt.segments(); ++i)
    for (const OptimizerStateGroup& g : opt.groups) {
      const OptimizerStateSlice& s = g.slices[i];
      const Parameter& p = state_.params[size_t(s.param_index)];
      if (p.tied_copy || (!zero && !replica_writer)) continue;
      todo.push_back({g.name, p.name, p.shard, s.param_offset, s.param_offset + s.data.numel(), s.data});
    }
  return todo;
}

// The snapshot is what the step stalls for; the file is written behind training.
void Checkpointer::snapshot(std::vector<SaveEntry>& entries, void* stream) {
  snapshot_.reset();
  for (SaveEntry& e : entries) {
    Tensor copy = snapshot_.alloc(e.data.flat().shape(), e.data.dtype(), e.name);
    copy_tensor(copy, e.data.flat(), stream, true);
    e.data = copy;
  }
}

// The first tensor that holds a non-finite value (its group and name), or "".
std::string Checkpointer::nonfinite_entry(const std::vector<SaveEntry>& entries, void* stream) const {
  for (const SaveEntry& e : entries)
    if (!all_finite(e.data, stream)) return str_cat("tensor '", e.name, "' (", e.group, ")");
  return {};
}

void Checkpointer::save(int64_t steps_done, void* stream, Timeline* tl) {
  finish();  // one save in flight at a time
  CheckpointDir dir(cfg_.checkpoint.dir);
  SaveJob job;
  job.tmp_dir = dir.tmp_dir(steps_done);
  job.steps_done = steps_done;
  pending_step_ = steps_done;
  job.entries = entries_to_save();
  const bool async = cfg_.checkpoint.async;
  if (async || device_ != Device::CPU) {
    SpanScope span(tl, "checkpoint_snapshot", Track::Main, -1, -1, int(steps_done));
    snapshot(job.entries, stream);
  }
  // A checkpoint is never written from non-finite state: the values it would
  // hold are checked first, and a refused save touches no directory.
  const std::string bad = nonfinite_entry(job.entries, stream);
  if (!settle(bad.empty() ? "" : str_cat(bad, " holds non-finite values (a checkpoint is never written from them)"),
              false))
    return;
  std::string why;
  if (is_logger()) try {
      dir.prepare(steps_done);
    } catch (const std::exception& e) {
      why = e.what();
    }
  if (!settle(why, true)) return;
  job.tl = tl;
  job.track = async ? Track::Checkpoint : Track::Main;
  job.kill = faults_.kills(steps_done);
  job.io_error = faults_.fails(steps_done);
  // The dynamic loss scale's state (nothing when there is none to continue).
  const LossScale& ls = state_.loss_scale;
  job.loss_scale = ls.dynamic() ? ls.scale() : 0.0;
  job.good_steps = ls.good_steps();
  job.hysteresis_left = ls.hysteresis_left();
  job.updates = state_.optimizer.updates;
  save_done_ = false;
  save_error_ = nullptr;
  if (async) {
    saver_ = std::thread([this, job = std::move(job)] { write(job); });
  } else {
    write(job);
    finish();
  }
}

// Runs on the saver thread (or inline): an error is kept for commit() to rethrow.
void Checkpointer::write(const SaveJob& job) {
  SpanScope span(job.tl, "checkpoint_write", job.track, -1, -1, int(job.steps_done));
  try {
    RankCheckpointWriter w(job.tmp_dir, grid_.world_rank(), job.steps_done);
    for (size_t i = 0; i < job.entries.size(); ++i) {
      const SaveEntry& e = job.entries[i];
      if (e.begin == 0 && e.end == e.data.numel() && e.group == "params")
        w.add(e.group, e.name, e.shard, e.data.view(e.shard.local_shape()));
      else
        w.add(e.group, e.name, e.shard, e.begin, e.end, e.data, e.data.dtype());
      if (job.kill && i == job.entries.size() / 2) faults_.kill(job.steps_done);  // the file half written
      if (job.io_error && i == job.entries.size() / 2) faults_.fail_write(job.steps_done, w.path() + ".tmp");
    }
    // A rank with no entries (nothing of the state lives there) fails or dies before its file is complete.
    if (job.kill) faults_.kill(job.steps_done);
    if (job.io_error) faults_.fail_write(job.steps_done, w.path() + ".tmp");
    // The data order is a pure function of (seed, step): the step is the loader's whole state.
    w.set_int("train.step", job.steps_done);
    w.set_int("optimizer.updates", job.updates);
    if (job.loss_scale > 0) {
      w.set_double("precision.loss_scale", job.loss_scale);
      w.set_int("precision.good_steps", job.good_steps);
      w.set_int("precision.hysteresis_left", job.hysteresis_left);
    }
    w.close();
  } catch (...) {
    save_error_ = std::current_exception();
  }
  save_done_ = true;
}

namespace {

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

void Checkpointer::commit() {
  // Every rank's file, then rank 0's commit: each outcome is agreed on.
  if (!settle(save_error_ ? message_of(save_error_) : "", true)) return;
  std::string why;
  if (is_logger()) try {
      CheckpointMeta meta;
      meta.step = pending_step_;
      // Context parallelism shards nothing: a dp x cp run's files are those of
      // dp * cp replicas (world rank ((pp * dp + d) * cp + c) * tp + t is rank
      // (pp * dp * cp + d * cp + c) * tp + t, and ZeRO-1 shards over the same
      // dp x cp ranks), so it records dp * cp and any layout reads it back.
      meta.layout = CheckpointLayout{cfg_.parallel.dp * cfg_.parallel.cp, cfg_.parallel.tp, cfg_.parallel.pp, cfg_.parallel.zero,
                                     cfg_.parallel.virtual_stages, cfg_.parallel.sequence_parallel,
                                     chunk_map(cfg_.parallel).order};
      meta.config_yaml = cfg_.yaml;
      CheckpointDir(cfg_.checkpoint.dir).commit(meta, cfg_.checkpoint.keep);
    } catch (const std::exception& e) {
      why = e.what();
    }
  if (!settle(why, true)) return;
  pending_step_ = -1;
}

// A save that failed on any rank, or was refused, is dropped everywhere:
// rank 0 removes its partial directory, so `latest` and the checkpoints
// already committed stay as they were. Then checkpoint.on_error=stop ends
// the run with the first failing rank's error; continue warns and trains on.
bool Checkpointer::settle(const std::string& why_here, bool remove_tmp) {
  const auto [rank, why] = lowest_rank_text(grid_.world(), !why_here.empty(), why_here);
  if (rank < 0) return true;
  const int64_t step = pending_step_;
  pending_step_ = -1;
  CheckpointDir dir(cfg_.checkpoint.dir);
  if (remove_tmp && is_logger()) {
    std::error_code ec;
    std::filesystem::remove_all(dir.tmp_dir(step), ec);
  }
  const std::optional<std::string> latest = dir.latest();
  const std::string kept = latest ? str_cat("latest stays ", *latest) : std::string("no checkpoint was saved before");
  grid_.world().barrier();  // the partial directory is gone before any rank reports
  if (cfg_.checkpoint.on_error == SaveErrorPolicy::Continue) {
    if (is_logger())
      std::fprintf(stderr, "warning: checkpoint step %lld not saved (rank %d: %s); %s; training goes on "
                   "(checkpoint.on_error=continue)\n", (long long)step, rank, why.c_str(), kept.c_str());
    return false;
  }
  throw AgreedError(ErrorKind::Checkpoint, str_cat("checkpoint step ", step, " not saved (rank ", rank, ": ", why, "); ",
                                                   kept, " (checkpoint.on_error=continue would train on)"));
}

void Checkpointer::poll() {
  if (pending_step_ < 0) return;
  // Every rank must have finished its file before rank 0 may commit.
  const double done = grid_.world().all_reduce_sum(save_done_ ? 1.0 : 0.0);
  if (done < grid_.shape().world()) return;
  if (saver_.joinable()) saver_.join();
  commit();
}

void Checkpointer::finish() {
  if (pending_step_ < 0) return;
  if (saver_.joinable()) saver_.join();
  grid_.world().barrier();
  commit();
  grid_.world().barrier();
}

// ---------------------------------------------------------------------------
// Resuming

std::optional<std::string> Checkpointer::resume_path() const {
  const CheckpointConfig& ck = cfg_.checkpoint;
  if (ck.resume == ResumeMode::Path) return ck.resume_path;
  if (ck.resume == ResumeMode::None || ck.dir.empty()) return std::nullopt;
  return CheckpointDir(ck.dir).latest();  // nullopt: a fresh run
}

int64_t Checkpointer::resume(DType model_dtype) {
  const std::optional<std::string> path = resume_path();
  if (!path) return 0;
  CheckpointReader r = CheckpointReader::open(*path);
  check_model(r, *path);
  // A 16-bit run's fp32 masters are finer than its 16-bit weights: a wider run takes them.
  const bool wide = model_dtype == DType::F32 || model_dtype == DType::F64;
  for (Parameter& p : state_.params)
    read(r, wide && r.has("master", p.name) ? "master" : "params", p, 0, p.value.numel(), p.value);
  read_optimizer(r, *path);
  restore_loss_scale(r);
  const int64_t step = r.step();
  if (step > cfg_.train.steps)
    fail(ErrorKind::Checkpoint, "checkpoint '", *path, "' is at step ", step, ", past train.steps=", cfg_.train.steps);
  if (print_) std::fprintf(stderr, "resumed from %s at step %lld\n", path->c_str(), (long long)step);
  return step;
}

// A checkpoint of another model is refused before anything is overwritten.
void Checkpointer::check_model(const CheckpointReader& r, const std::string& path) const {
  for (const Parameter& p : state_.params) {
    if (!r.has("params", p.name))
      fail(ErrorKind::Checkpoint, "checkpoint '", path, "' has no tensor '", p.name,
           "': it was saved from a different model");
    const Shape g = r.global_shape("params", p.name);
    if (g != p.shard.global)
      fail(ErrorKind::Checkpoint, "checkpoint '", path, "': tensor '", p.name, "' has shape ", g.str(),
           " but this model's is ", p.shard.global.str(), " (a different model.* shape)");
  }
}

void Checkpointer::read_optimizer(const CheckpointReader& r, const std::string& path) {
  OptimizerState& opt = state_.optimizer;
  // A params-only checkpoint (an imported model, `ckpt convert --params-only`)
  // has none of the groups that keep their own start (the moments): the
  // optimizer keeps the zeroed state it was built with.
  bool has_optimizer_state = false;
  for (const OptimizerStateGroup& g : opt.groups)
    for (const CheckpointEntry& e : r.entries())
      has_optimizer_state = has_optimizer_state || (g.fallback == StateFallback::Keep && e.group == g.name);
  if (!has_optimizer_state && print_)
    std::fprintf(stderr, "checkpoint %s has no optimizer state (parameters only): %s starts fresh at step %lld\n",
                 path.c_str(), opt.optimizer.c_str(), (long long)r.step());
  // The moments' bias correction continues from the saved update count
  // (older checkpoints: one update per step); fresh moments start from 0.
  if (has_optimizer_state)
    opt.updates = r.has_scalar(0, "optimizer.updates") ? r.get_int(0, "optimizer.updates") : r.step();
  for (const OptimizerStateGroup& g : opt.groups)
    for (const OptimizerStateSlice& s : g.slices) {
      const Parameter& p = state_.params[size_t(s.param_index)];
      const int64_t b = s.param_offset, e = b + s.data.numel();
      if (g.fallback == StateFallback::Keep) {
        if (has_optimizer_state) read(r, g.name, p, b, e, s.data);
      } else {
        // fp32 master weights: those a bf16/fp16 run saved, else the
        // checkpoint's parameters widened (an fp32 run's are the masters exactly).
        read(r, r.has(g.name, p.name) ? std::string_view(g.name) : std::string_view("params"), p, b, e, s.data);
      }
    }
}

// The loss scale continues where it was (every rank saved the same value).
void Checkpointer::restore_loss_scale(const CheckpointReader& r) {
  LossScale& ls = state_.loss_scale;
  if (!ls.dynamic() || !r.has_scalar(0, "precision.loss_scale")) return;
  ls.restore(r.get_double(0, "precision.loss_scale"), int(r.get_int(0, "precision.good_steps")),
             r.has_scalar(0, "precision.hysteresis_left") ? int(r.get_int(0, "precision.hysteresis_left"))
                                                          : cfg_.precision.hysteresis);
}

void Checkpointer::read(const CheckpointReader& r, std::string_view group, const Parameter& p, int64_t begin,
                        int64_t end, Tensor dst) const {
  if (dst.device() == Device::CPU) {
    r.read(group, p.name, p.shard, begin, end, dst);
    return;
  }
  std::vector<char> host(dst.bytes());
  r.read(group, p.name, p.shard, begin, end, Tensor(host.data(), dst.flat().shape(), dst.dtype()));
  copy_bytes(dst.raw(), dst.device(), host.data(), Device::CPU, dst.bytes(), nullptr, true);
}

}  // namespace xirang
