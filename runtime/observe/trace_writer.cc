#include "runtime/observe/trace_writer.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace xirang {

namespace {

using json = nlohmann::ordered_json;

// Transfers overlap one another (a bucket is launched while the previous
// one is in flight): each track's spans go to the first lane free at their
// start, so that every lane's spans are disjoint. Main and the device
// stream nest or follow each other, and keep one lane.
std::vector<int> assign_lanes(const std::vector<Span>& spans, const std::vector<size_t>& order) {
  std::vector<int> lane(spans.size(), 0);
  std::vector<std::vector<double>> free_at(kTrackCount);  // per track, per lane: when its last span ends
  for (size_t i : order) {
    const Span& s = spans[i];
    if (s.track == Track::Main || s.track == Track::Device) continue;
    auto& lanes = free_at[size_t(s.track)];
    size_t l = 0;
    while (l < lanes.size() && lanes[l] > s.t0) ++l;
    if (l == lanes.size()) lanes.push_back(0);
    lanes[l] = s.t1;
    lane[i] = int(l);
  }
  return lane;
}

// Spans whose index is a step number (the others' is a bucket's).
bool indexed_by_step(const char* name) {
  for (const char* n : {"step", "eval", "checkpoint_save", "checkpoint_snapshot", "checkpoint_write"})
    if (std::strcmp(name, n) == 0) return true;
  return false;
}

int thread_id(Track t, int lane) { return 1 + int(t) * 64 + lane; }

std::string process_label(const TraceRankInfo& info) {
  return str_cat("rank ", info.world_rank, " (dp ", info.coords.dp, ", tp ", info.coords.tp, ", pp ", info.coords.pp,
                 ")");
}

}  // namespace

std::string rank_trace_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.json", rank);
  return buf;
}

std::string write_rank_trace(const std::string& dir, const TraceRankInfo& info, const std::vector<Span>& spans) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Config, "metrics.trace: cannot create directory '", dir, "': ", ec.message());
  std::vector<size_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a].t0 < spans[b].t0; });
  const std::vector<int> lane = assign_lanes(spans, order);

  const int pid = info.world_rank;
  json events = json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"tid", 0},
                    {"args", {{"name", process_label(info)}}}});
  events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"tid", 0},
                    {"args", {{"sort_index", pid}}}});
  // One named thread per (track, lane) in use.
  std::vector<int> lanes_used(kTrackCount, 0);
  for (size_t i = 0; i < spans.size(); ++i)
    lanes_used[size_t(spans[i].track)] = std::max(lanes_used[size_t(spans[i].track)], lane[i] + 1);
  for (int t = 0; t < kTrackCount; ++t)
    for (int l = 0; l < lanes_used[size_t(t)]; ++l) {
      const std::string name = l == 0 ? track_name(Track(t)) : str_cat(track_name(Track(t)), " #", l + 1);
      const int tid = thread_id(Track(t), l);
      events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}});
      events.push_back(
          {{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", pid}, {"tid", tid}, {"args", {{"sort_index", tid}}}});
    }
  for (size_t i : order) {
    const Span& s = spans[i];
    json args = json::object();
    if (s.microbatch >= 0) args["microbatch"] = s.microbatch;
    if (s.chunk >= 0) args["chunk"] = s.chunk;
    if (s.index >= 0) args[indexed_by_step(s.name) ? "step" : "index"] = s.index;
    if (s.bytes >= 0) args["bytes"] = s.bytes;
    // Microseconds with a nanosecond fraction: durations of short spans survive.
    events.push_back({{"ph", "X"},
                      {"name", s.name},
                      {"cat", track_name(s.track)},
                      {"pid", pid},
                      {"tid", thread_id(s.track, lane[i])},
                      {"ts", std::round(s.t0 * 1e9) / 1e3},
                      {"dur", std::max(0.0, std::round((s.t1 - s.t0) * 1e9) / 1e3)},
                      {"args", std::move(args)}});
  }
  json doc = {{"displayTimeUnit", "ms"},
              {"otherData",
               {{"format", "xirang-trace-1"},
                {"job", info.job},
                {"rank", info.world_rank},
                {"world_size", info.world_size},
                {"dp", info.coords.dp},
                {"cp", info.coords.cp},
                {"tp", info.coords.tp},
                {"pp", info.coords.pp},
                {"first_step", info.first_step},
                {"last_step", info.last_step},
                {"clock", "steady"},
                {"clock_sync_us", std::round(info.clock_sync_s * 1e9) / 1e3}}},
              {"traceEvents", std::move(events)}};
  const std::string path = (std::filesystem::path(dir) / rank_trace_name(info.world_rank)).string();
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) fail(ErrorKind::Config, "metrics.trace: cannot write '", tmp, "': ", std::strerror(errno));
  const std::string text = doc.dump() + "\n";
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) fail(ErrorKind::Config, "metrics.trace: writing '", tmp, "' failed (disk full?)");
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail(ErrorKind::Config, "metrics.trace: cannot rename '", tmp, "' to '", path, "': ", ec.message());
  return path;
}

double barrier_clock_sync(Communicator& world) {
  // The first barriers warm the connections up; the last one's exit is the reference.
  double t = 0;
  for (int i = 0; i < 3; ++i) {
    world.barrier();
    t = now_seconds();
  }
  return t;
}

TraceWindow::TraceWindow(const MetricsConfig& m, ProcessGrid& grid)
    : dir_(m.trace), first_(m.trace_steps.first), last_(m.trace_steps.last), grid_(grid) {
  info_.world_rank = grid.world_rank();
  info_.world_size = grid.shape().world();
  info_.coords = grid.coords();
  info_.job = m.job;
}

void TraceWindow::before_step(int step, Timeline& tl) {
  if (!enabled() || open_ || done_ || step < first_ || step > last_) return;
  info_.clock_sync_s = barrier_clock_sync(grid_.world());
  tl.take_spans();  // nothing from before the window
  tl.set_tracing(true);
  open_ = true;
}

void TraceWindow::after_step(int step, Timeline& tl) {
  if (!open_) return;
  if (end_s_ == 0) {
    if (step < last_) return;
    last_traced_ = step;
    end_s_ = now_seconds();
  }
  if (tl.open_spans() == 0) write(tl);
}

void TraceWindow::finish(Timeline& tl) {
  if (!open_) return;
  if (end_s_ == 0) end_s_ = now_seconds();  // training ended inside the window
  write(tl);  // the caller has joined the checkpoint writer
}

void TraceWindow::write(Timeline& tl) {
  tl.set_tracing(false);
  open_ = false;
  done_ = true;
  std::vector<Span> spans = tl.take_spans();
  // Steps after the window ran while a write begun inside it finished.
  spans.erase(std::remove_if(spans.begin(), spans.end(), [&](const Span& s) { return s.t0 > end_s_; }), spans.end());
  if (last_traced_ < 0)  // ended inside the window: up to the last step traced
    for (const Span& s : spans)
      if (std::strcmp(s.name, "step") == 0) last_traced_ = std::max(last_traced_, s.index);
  info_.first_step = first_;
  info_.last_step = last_traced_;
  path_ = write_rank_trace(dir_, info_, spans);
}

}  // namespace xirang
