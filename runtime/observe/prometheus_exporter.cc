#include "runtime/observe/prometheus_exporter.h"

#include <httplib.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "runtime/observe/step_fields.h"

namespace xirang {

namespace {

// One gauge: its name (base units, xirang_ prefix), its help, and its value in a step.
struct Gauge {
  const char* name;
  const char* help;
  double (*value)(const StepMetrics&);
};

constexpr double kMs = 1e-3;  // StepMetrics keeps milliseconds; Prometheus wants seconds

// The order is the order of the text: these, the step's times
// (runtime/observe/step_fields.h), then kTailGauges.
const Gauge kHeadGauges[] = {
    {"xirang_step", "Number of the last finished step (1-based).", [](const StepMetrics& m) { return double(m.step); }},
    {"xirang_tokens_per_second", "Tokens per second of the job over the last step.",
     [](const StepMetrics& m) { return m.tokens_per_s; }},
    {"xirang_mfu_ratio", "Model FLOPs utilization of the last step: this rank's share of the FLOPs over its peak.",
     [](const StepMetrics& m) { return m.mfu; }},
};
const Gauge kTailGauges[] = {
    {"xirang_loss", "Training loss of the last step (nats per token, mean over the global batch).",
     [](const StepMetrics& m) { return m.loss; }},
    {"xirang_grad_norm", "Global gradient norm of the last step, before clipping.",
     [](const StepMetrics& m) { return m.grad_norm; }},
    {"xirang_loss_scale", "Loss scale the last step ran with (1: none).", [](const StepMetrics& m) { return m.loss_scale; }},
    {"xirang_learning_rate", "Learning rate of the last step.", [](const StepMetrics& m) { return m.lr; }},
    {"xirang_data_prefetch_depth", "Microbatches the data loader keeps in flight.",
     [](const StepMetrics& m) { return double(m.data_prefetch_depth); }},
    {"xirang_straggler_ratio",
     "Compute time of the slowest rank over the median rank's at the last straggler check (0: not checked yet).",
     [](const StepMetrics& m) { return m.straggler_ratio; }},
    {"xirang_slowest_rank", "World rank with the longest compute time at the last straggler check (-1: none yet).",
     [](const StepMetrics& m) { return double(m.slowest_rank); }},
    {"xirang_below_baseline", "1 while tokens/s stays below metrics.baseline's tolerance band, else 0.",
     [](const StepMetrics& m) { return m.below_baseline ? 1.0 : 0.0; }},
};

// Go's ParseFloat spellings, shortest round-trip otherwise.
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// A label value: backslash, double quote and line feed escaped.
std::string label_value(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void family(std::string& out, const char* name, const char* type, const char* help) {
  out += str_cat("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void sample(std::string& out, const char* name, const std::string& labels, double v) {
  out += str_cat(name, labels, " ", number(v), "\n");
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *end == '\0' && n >= 0 ? int(n) : -1;
}

}  // namespace

PrometheusMetrics::PrometheusMetrics(std::string job, int rank, PrometheusRun run)
    : labels_(str_cat("{job=\"", label_value(job), "\",rank=\"", rank, "\"}")), run_(run) {}

void PrometheusMetrics::update(const StepMetrics& m) {
  last_ = m;
  steps_ += 1;
  tokens_ += run_.tokens_per_step;
  if (m.skipped) skipped_ += 1;
  if (m.checkpoint_saved) checkpoints_ += 1;
  if (m.energy) energy_j_ += m.energy->joules;
}

std::string PrometheusMetrics::text() const {
  std::string out;
  for (const Gauge& g : kHeadGauges) {
    family(out, g.name, "gauge", g.help);
    if (last_) sample(out, g.name, labels_, g.value(*last_));
  }
  for (const StepField& f : step_fields()) {
    if (!f.gauge) continue;
    family(out, f.gauge, "gauge", f.help);
    if (last_) sample(out, f.gauge, labels_, (*last_).*f.value * kMs);
  }
  for (const Gauge& g : kTailGauges) {
    family(out, g.name, "gauge", g.help);
    if (last_) sample(out, g.name, labels_, g.value(*last_));
  }
  family(out, "xirang_validation_loss", "gauge", "Validation loss at the last evaluation (nats per token).");
  if (last_ && last_->val_loss) sample(out, "xirang_validation_loss", labels_, *last_->val_loss);
  family(out, "xirang_memory_planned_bytes", "gauge", "Memory this rank planned at start (the memory plan's total).");
  sample(out, "xirang_memory_planned_bytes", labels_, run_.memory_planned_bytes);
  family(out, "xirang_steps_total", "counter", "Training steps finished by this process.");
  sample(out, "xirang_steps_total", labels_, steps_);
  family(out, "xirang_tokens_total", "counter", "Tokens the job trained on in the steps this process finished.");
  sample(out, "xirang_tokens_total", labels_, tokens_);
  family(out, "xirang_skipped_steps_total", "counter", "Steps skipped because the gradients overflowed (fp16).");
  sample(out, "xirang_skipped_steps_total", labels_, skipped_);
  family(out, "xirang_checkpoints_total", "counter", "Checkpoints saved by this process.");
  sample(out, "xirang_checkpoints_total", labels_, checkpoints_);
  // Only where this rank's device energy is measured (a CUDA run whose NVML gives readings).
  if (run_.energy) {
    family(out, "xirang_power_watts", "gauge",
           "Mean power of this rank's GPU over the last step (the whole device, as NVML reports it).");
    if (last_ && last_->energy) sample(out, "xirang_power_watts", labels_, last_->energy->avg_watts);
    family(out, "xirang_energy_joules_total", "counter",
           "Energy of this rank's GPU over the steps this process finished (the whole device).");
    sample(out, "xirang_energy_joules_total", labels_, energy_j_);
  }
  return out;
}

std::optional<Endpoint> prometheus_endpoint(const MetricsConfig& m, int world_rank, int local_rank) {
  if (m.prometheus.empty() || (!m.prometheus_per_rank && world_rank != 0)) return std::nullopt;
  // The config validated HOST:PORT with a port in 1..65535.
  const size_t colon = m.prometheus.rfind(':');
  Endpoint e{m.prometheus.substr(0, colon), std::stoi(m.prometheus.substr(colon + 1))};
  if (m.prometheus_per_rank) {
    e.port += local_rank;
    if (e.port > 65535)
      fail(ErrorKind::Config, "metrics.prometheus_per_rank: local rank ", local_rank, " would serve on port ", e.port,
           " past 65535 (metrics.prometheus='", m.prometheus, "')");
  }
  // A bracketed IPv6 host ("[::1]:9400") is passed to the resolver bare.
  if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') e.host = e.host.substr(1, e.host.size() - 2);
  return e;
}

int local_rank_from_env(int world_rank) {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (int r = env_int(v); r >= 0) return r;
  return world_rank;
}

PrometheusExporter::PrometheusExporter(const Endpoint& at, const std::string& key, PrometheusMetrics metrics)
    : metrics_(std::move(metrics)), server_(std::make_unique<httplib::Server>()) {
  // httplib's default sets SO_REUSEPORT, which would let two jobs share a
  // port silently; SO_REUSEADDR alone still allows a quick restart.
  server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  errno = 0;
  // Bound sockets listen already: a scrape that comes before the thread runs waits in the backlog.
  const bool bound = at.port == 0 ? (port_ = server_->bind_to_any_port(at.host)) > 0
                                  : server_->bind_to_port(at.host, port_ = at.port);
  if (!bound)
    fail(ErrorKind::Config, key, ": cannot listen on ", at.host, ":", at.port, " (",
         errno ? std::strerror(errno) : "the address does not resolve to a local interface", ")");
  thread_ = std::thread([this] {
    server_->listen_after_bind();
    served_ = true;
  });
  // stop() is a no-op until the server runs: wait, so destruction always ends it.
  while (!server_->is_running() && !served_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

PrometheusExporter::~PrometheusExporter() {
  server_->stop();
  thread_.join();
}

void PrometheusExporter::on_step(StepMetrics& m) {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.update(m);
}

std::string PrometheusExporter::text() const {
  std::lock_guard<std::mutex> lock(mu_);
  return metrics_.text();
}

void add_prometheus_exporter(std::vector<std::unique_ptr<StepObserver>>& observers, const MetricsConfig& m,
                             int world_rank, PrometheusRun run) {
  const std::optional<Endpoint> at = prometheus_endpoint(m, world_rank, local_rank_from_env(world_rank));
  if (!at) return;
  const char* key = m.prometheus_per_rank ? "metrics.prometheus (per rank)" : "metrics.prometheus";
  observers.push_back(std::make_unique<PrometheusExporter>(*at, key, PrometheusMetrics(m.job, world_rank, run)));
}

}  // namespace xirang
