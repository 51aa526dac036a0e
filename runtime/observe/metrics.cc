#include "runtime/observe/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/device_memory.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "runtime/observe/step_fields.h"

namespace xirang {

double measure_sgemm_flops(int n, double seconds) {
  std::vector<float> a(size_t(n) * n), b(size_t(n) * n), c(size_t(n) * n);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = float(i % 7) * 0.1f - 0.3f;
    b[i] = float(i % 5) * 0.2f - 0.4f;
  }
  Tensor ta(a.data(), {n, n}, DType::F32), tb(b.data(), {n, n}, DType::F32), tc(c.data(), {n, n}, DType::F32);
  KernelContext ctx;
  matmul(ctx, tc, ta, tb, false, false);  // warm-up: thread start, page faults
  int reps = 0;
  double best = 0;
  Stopwatch total;
  while (total.seconds() < seconds || reps < 3) {
    Stopwatch sw;
    matmul(ctx, tc, ta, tb, false, false);
    double rate = 2.0 * n * double(n) * n / sw.seconds();
    best = std::max(best, rate);  // the best repetition: a limit, not an average of noise
    ++reps;
  }
  return best;
}

double measure_device_gemm_flops(const KernelContext& ctx, DType dtype, int n, int reps) {
  KernelContext c = ctx;
  c.timeline = nullptr;  // not an op of any step's profile
  const int64_t count = int64_t(n) * n;
  // Random values (zeros multiply measurably faster): a fixed xorshift
  // stream in [-1, 1), rounded to `dtype` on the host, then uploaded.
  std::vector<float> host(size_t(count), 0.f);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (float& v : host) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = float(double(x >> 40) / double(1ull << 23) - 1.0);
  }
  Tensor h32(host.data(), {n, n}, DType::F32);
  std::vector<char> rounded(size_t(count) * dtype_size(dtype));
  Tensor h(rounded.data(), {n, n}, dtype);
  cast(KernelContext{}, h, h32);
  const size_t bytes = rounded.size();
  void* mem[3];
  const char* what[3] = {"gemm rate a", "gemm rate b", "gemm rate c"};
  for (int i = 0; i < 3; ++i) mem[i] = device_alloc(c.device, bytes, what[i]);
  copy_bytes(mem[0], c.device, rounded.data(), Device::CPU, bytes, c.cuda_stream, true);
  copy_bytes(mem[1], c.device, rounded.data() + bytes / 2, Device::CPU, bytes / 2, c.cuda_stream, true);
  copy_bytes(static_cast<char*>(mem[1]) + bytes / 2, c.device, rounded.data(), Device::CPU, bytes / 2, c.cuda_stream,
             true);
  Tensor a(mem[0], {n, n}, dtype, c.device), b(mem[1], {n, n}, dtype, c.device), out(mem[2], {n, n}, dtype, c.device);
  char probe = 0;
  auto drain = [&] { copy_bytes(&probe, Device::CPU, mem[2], c.device, 1, c.cuda_stream, true); };
  for (int i = 0; i < 2; ++i) matmul(c, out, a, b, false, true);  // heuristics, clocks up
  drain();
  Stopwatch sw;
  for (int i = 0; i < reps; ++i) matmul(c, out, a, b, false, true);
  drain();
  const double seconds = sw.seconds();
  for (void* p : mem) device_free(c.device, p);
  return 2.0 * double(n) * n * n * reps / seconds;
}

MetricsLog::MetricsLog(const std::string& path, PeakFlops peak, JsonlFields fields)
    : path_(path), peak_(std::move(peak)), fields_(fields) {
  if (path_.empty()) return;
  std::filesystem::path p(path_);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  f_ = std::fopen(path_.c_str(), "w");
  if (!f_) fail(ErrorKind::Config, "metrics.jsonl: cannot open '", path_, "' for writing: ", std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::write(const StepMetrics& m) {
  if (!f_) return;
  nlohmann::ordered_json j = {
      {"step", m.step}, {"loss", m.loss}, {"lr", m.lr}, {"grad_norm", m.grad_norm}, {"tokens_per_s", m.tokens_per_s}};
  // The step's times in the table's order, mfu after step_ms and the
  // loader's depth after its wait (the order metrics.jsonl always had).
  for (const StepField& f : step_fields()) {
    j[f.key] = m.*f.value;
    if (f.kind == StepField::Kind::Total) j["mfu"] = m.mfu;
    if (f.part == StepPart::DataWait) j["data_prefetch_depth"] = m.data_prefetch_depth;
  }
  j["loss_scale"] = m.loss_scale;
  j["skipped"] = m.skipped;
  j["peak_tflops"] = peak_.flops / 1e12;
  j["peak_source"] = peak_.source;
  j["memory_planned_bytes"] = planned_bytes_;
  j["backend"] = backend_;
  if (m.cpu_wait_ms) j["cpu_wait_ms"] = *m.cpu_wait_ms;
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  if (fields_.straggler) {
    j["slowest_rank"] = m.slowest_rank;
    j["straggler_ratio"] = m.straggler_ratio;
    j["straggler_extra_ms"] = m.straggler_extra_ms;
  }
  if (fields_.baseline) j["below_baseline"] = m.below_baseline;
  if (m.energy) {
    j["energy_j"] = m.energy->joules;
    j["joules_per_token"] = m.energy->joules_per_token;
    j["avg_watts"] = m.energy->avg_watts;
    j["energy_source"] = energy_source_;
  }
  if (fields_.ops && m.ops) {
    nlohmann::ordered_json ms = nlohmann::ordered_json::object(), calls = nlohmann::ordered_json::object();
    for (int k = 0; k < kOpKindCount; ++k) {
      if (m.ops->calls[size_t(k)] == 0) continue;
      ms[op_kind_name(OpKind(k))] = m.ops->ms[size_t(k)];
      calls[op_kind_name(OpKind(k))] = m.ops->calls[size_t(k)];
    }
    j["op_ms"] = std::move(ms);
    j["op_calls"] = std::move(calls);
  }
  std::string line = j.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), f_);
  std::fflush(f_);  // a crashed run still leaves every finished step on disk
}

ProgressLine::ProgressLine(int total_steps, int every)
    : total_(total_steps), every_(std::max(1, every)), tty_(isatty(STDERR_FILENO)) {}

void ProgressLine::update(const StepMetrics& m, double elapsed_s) {
  const bool last = m.step == total_;
  if (!tty_ && !(m.step % every_ == 0 || last || m.step == 1 || m.val_loss)) return;
  const double eta = m.step > 0 ? elapsed_s / m.step * (total_ - m.step) : 0;
  char val[48] = "";
  if (m.val_loss) std::snprintf(val, sizeof val, " | val %.4f", *m.val_loss);
  std::fprintf(stderr, "%sstep %d/%d | loss %.4f%s | lr %.2e | %.0f tok/s | MFU %.1f%% | %.0f ms | ETA %dm%02ds%s",
               tty_ ? "\r\033[K" : "", m.step, total_, m.loss, val, m.lr, m.tokens_per_s, 100 * m.mfu, m.step_ms,
               int(eta) / 60, int(eta) % 60, tty_ ? "" : "\n");
  // On a terminal, keep eval lines visible; other steps overwrite each other.
  if (tty_ && m.val_loss) std::fputc('\n', stderr);
  open_ = tty_ && !m.val_loss;
  std::fflush(stderr);
}

void ProgressLine::finish() {
  if (open_) std::fputc('\n', stderr);
  open_ = false;
}

}  // namespace xirang
