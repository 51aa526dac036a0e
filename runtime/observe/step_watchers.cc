#include "runtime/observe/step_watchers.h"

#include <utility>

namespace xirang {

JsonlObserver::JsonlObserver(std::string path, PeakFlops peak, JsonlFields fields, size_t planned_bytes,
                             std::string backend, std::string energy_source)
    : path_(std::move(path)),
      backend_(std::move(backend)),
      energy_source_(std::move(energy_source)),
      peak_(std::move(peak)),
      fields_(fields),
      planned_bytes_(planned_bytes) {}

void JsonlObserver::on_step_begin(int) {
  if (log_) return;
  log_ = std::make_unique<MetricsLog>(path_, peak_, fields_);
  log_->set_planned_bytes(planned_bytes_);
  log_->set_backend(backend_);
  if (!energy_source_.empty()) log_->set_energy_source(energy_source_);
}

}  // namespace xirang
