// runtime/observe/prometheus_exporter.h: the Prometheus endpoint (metrics.prometheus).
//
// A step observer that serves GET /metrics in the Prometheus text exposition
// format (version 0.0.4) from a server thread (cpp-httplib). Each step
// replaces the gauges (the last step's tokens/s, MFU, time breakdown in
// seconds, loss, the device's power, ...) and advances the counters (steps,
// tokens, skipped steps, checkpoints, the device's joules), under a mutex. Every sample carries the labels
// job (metrics.job) and rank. World rank 0 serves the job's values at
// metrics.prometheus; with metrics.prometheus_per_rank every rank serves its
// own at PORT + its local rank (the rank within its node).
//
//   add_prometheus_exporter(observers, cfg.metrics, world_rank,
//                           PrometheusRun{tokens_per_step, plan.total()});
//   // ... the trainer calls on_step(m) after each step; scrapes read text().
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/observe/step_observer.h"

namespace httplib {
class Server;
}

namespace xirang {

// What the run fixes before its first step.
struct PrometheusRun {
  double tokens_per_step = 0;      // global_batch x seq_len: the job's tokens per step
  double memory_planned_bytes = 0; // this rank's memory plan total
  bool energy = false;             // this rank's device energy is measured (the energy families exist)
};

// The values one endpoint exposes, and their text. Gauges have no sample
// before the first step; counters start at 0.
class PrometheusMetrics {
 public:
  PrometheusMetrics(std::string job, int rank, PrometheusRun run);
  void update(const StepMetrics& m);
  std::string text() const;  // the exposition format, version 0.0.4

 private:
  std::string labels_;  // {job="...",rank="N"}
  PrometheusRun run_;
  std::optional<StepMetrics> last_;
  double steps_ = 0, tokens_ = 0, skipped_ = 0, checkpoints_ = 0;
  double energy_j_ = 0;  // the device's joules over the measured steps
};

// HOST and PORT of the endpoint this rank serves under `m`; none when it
// serves none (metrics.prometheus empty, or another rank's job).
struct Endpoint {
  std::string host;
  int port = 0;
};
std::optional<Endpoint> prometheus_endpoint(const MetricsConfig& m, int world_rank, int local_rank);

// This process's rank within its node, from the launcher's environment
// (Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, MPICH's MPI_LOCALRANKID, Slurm's
// SLURM_LOCALID); the world rank when none is set.
int local_rank_from_env(int world_rank);

class PrometheusExporter : public StepObserver {
 public:
  // Listens on `at` before returning (port 0: any free port, for tests);
  // an address that cannot be bound is a Config error naming `key`.
  PrometheusExporter(const Endpoint& at, const std::string& key, PrometheusMetrics metrics);
  ~PrometheusExporter() override;  // stops the server and joins its thread
  PrometheusExporter(const PrometheusExporter&) = delete;
  PrometheusExporter& operator=(const PrometheusExporter&) = delete;

  void on_step(StepMetrics& m) override;
  int port() const { return port_; }
  std::string text() const;

 private:
  mutable std::mutex mu_;
  PrometheusMetrics metrics_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> served_{false};  // the server thread has returned
  int port_ = 0;
};

// Adds this rank's exporter to `observers` when the config asks for one.
void add_prometheus_exporter(std::vector<std::unique_ptr<StepObserver>>& observers, const MetricsConfig& m,
                             int world_rank, PrometheusRun run);

}  // namespace xirang
