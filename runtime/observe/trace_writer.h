// runtime/observe/trace_writer.h: metrics.trace's per-rank files.
//
// While a trace window (metrics.trace_steps) is open, the rank's Timeline
// keeps spans; when it closes, write_rank_trace() writes them as one Chrome
// trace-event JSON file (the format Perfetto and chrome://tracing open):
// the rank is one process named by its coordinates, each Track one thread
// ("compute", "dp reductions", "pp sends", ...), and transfers that overlap
// one another are spread over lanes ("dp reductions #2"). Timestamps are
// the steady clock in microseconds; `otherData.clock_sync_us` is the same
// clock when the ranks left a common barrier at the window's start, which
// `xirang trace merge` subtracts to put every rank on one time axis
// (docs/observability.md describes the format).
//
//   TraceWindow window(cfg.metrics, grid);     // nothing to do when metrics.trace is empty
//   window.before_step(step, timeline);        // opens at trace_steps.first (a barrier on the world)
//   window.after_step(step, timeline);         // writes the file after trace_steps.last
#pragma once

#include <string>
#include <vector>

#include "comm/process_grid.h"
#include "core/timeline.h"
#include "runtime/config/config.h"

namespace xirang {

struct TraceRankInfo {
  int world_rank = 0, world_size = 1;
  GridCoords coords;
  std::string job;
  int first_step = 0, last_step = 0;  // the steps the trace covers
  double clock_sync_s = 0;            // steady clock at the window's barrier
};

// DIR/rank_NNNNN.json (created with its directory); returns the path.
std::string write_rank_trace(const std::string& dir, const TraceRankInfo& info, const std::vector<Span>& spans);
// The file name of world rank `rank` in a trace directory.
std::string rank_trace_name(int rank);

// The steady clock when this rank left the last of a few barriers over
// `world`: a common instant for all ranks, within the barrier's skew.
double barrier_clock_sync(Communicator& world);

// Opens and closes the trace window of a training run.
class TraceWindow {
 public:
  TraceWindow(const MetricsConfig& m, ProcessGrid& grid);
  bool enabled() const { return !dir_.empty(); }
  // Before step `step` (1-based) starts: at the window's first step (or the
  // first step a resumed run makes inside the window), every rank
  // synchronizes its clock reference and tracing starts. Every rank runs
  // the same steps, so all of them take part in the barrier.
  void before_step(int step, Timeline& tl);
  // After step `step` is complete: after the window's last, the file is
  // written, once no span begun inside the window is still open (a
  // checkpoint write on its own thread): until then tracing goes on and
  // only spans that began inside the window are written.
  void after_step(int step, Timeline& tl);
  // Training ended: a window still open is written with the steps it has.
  void finish(Timeline& tl);
  const std::string& last_path() const { return path_; }

 private:
  void write(Timeline& tl);
  std::string dir_;
  int first_ = 0, last_ = 0;
  bool open_ = false, done_ = false;
  int last_traced_ = -1;  // the last step inside the window once it has ended
  double end_s_ = 0;      // when it ended (steady clock); 0 while open
  TraceRankInfo info_;
  ProcessGrid& grid_;
  std::string path_;
};

}  // namespace xirang
