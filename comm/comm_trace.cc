#include "comm/comm_trace.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/clock.h"
#include "core/error.h"

namespace xirang {

const char* comm_op_kind_name(CommOpKind k) {
  switch (k) {
    case CommOpKind::AllReduce: return "all_reduce";
    case CommOpKind::ReduceScatter: return "reduce_scatter";
    case CommOpKind::AllGather: return "all_gather";
    case CommOpKind::Broadcast: return "broadcast";
    case CommOpKind::Barrier: return "barrier";
    case CommOpKind::Send: return "send";
    case CommOpKind::Recv: return "recv";
    case CommOpKind::AllToAllV: return "all_to_all_v";
  }
  return "?";
}

const char* comm_op_state_name(CommOpState s) {
  switch (s) {
    case CommOpState::Posted: return "posted";
    case CommOpState::InFlight: return "in_flight";
    case CommOpState::Done: return "done";
    case CommOpState::Failed: return "failed";
  }
  return "?";
}

CommTrace::CommTrace(int world_rank, int world_size, std::string dump_dir, size_t capacity)
    : world_rank_(world_rank), world_size_(world_size), dir_(std::move(dump_dir)), ring_(capacity > 0 ? capacity : 1) {}

int CommTrace::add_channel(const std::string& group, int rank, std::vector<int> world_ranks) {
  std::lock_guard<std::mutex> lk(mu_);
  int instance = 0;
  for (const CommChannel& c : channels_)
    if (c.group == group) ++instance;
  channels_.push_back({group, instance, rank, std::move(world_ranks)});
  return int(channels_.size()) - 1;
}

CommOpRecord* CommTrace::slot(uint64_t id) {
  if (id == 0) return nullptr;
  CommOpRecord& r = ring_[(id - 1) % ring_.size()];
  return r.id == id ? &r : nullptr;
}

uint64_t CommTrace::posted(int channel, CommOpKind kind, int peer, int tag, int64_t bytes, uint64_t seq,
                           double now_s) {
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t id = next_id_++;
  ring_[(id - 1) % ring_.size()] = CommOpRecord{id, channel, kind, CommOpState::Posted, peer, tag, seq, bytes, now_s, 0, 0};
  return id;
}

void CommTrace::started(uint64_t id, double now_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (CommOpRecord* r = slot(id)) {
    r->state = CommOpState::InFlight;
    r->started_s = now_s;
  }
}

void CommTrace::completed(uint64_t id, bool ok, double now_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (CommOpRecord* r = slot(id)) {
    r->state = ok ? CommOpState::Done : CommOpState::Failed;
    r->completed_s = now_s;
  }
}

std::vector<CommOpRecord> CommTrace::records() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<CommOpRecord> out;
  const uint64_t n = ring_.size(), first = next_id_ > n ? next_id_ - n : 1;
  for (uint64_t id = first; id < next_id_; ++id) out.push_back(ring_[(id - 1) % n]);
  return out;
}

std::vector<CommChannel> CommTrace::channels() const {
  std::lock_guard<std::mutex> lk(mu_);
  return channels_;
}

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", s);
  return buf;
}

}  // namespace

// One operation per line, so that the file also reads well as text.
std::string CommTrace::to_json(const std::string& reason, double now_s) const {
  const std::vector<CommOpRecord> recs = records();
  const std::vector<CommChannel> chans = channels();
  std::string j = str_cat("{\"format\": \"xirang-comm-trace-1\", \"rank\": ", world_rank_, ", \"world_size\": ",
                          world_size_, ", \"time_s\": ", seconds(now_s), ",\n \"reason\": ", json_string(reason),
                          ",\n \"channels\": [");
  for (size_t i = 0; i < chans.size(); ++i) {
    const CommChannel& c = chans[i];
    j += str_cat(i ? ",\n  " : "\n  ", "{\"group\": ", json_string(c.group), ", \"instance\": ", c.instance,
                 ", \"rank\": ", c.rank, ", \"world_ranks\": [");
    for (size_t k = 0; k < c.world_ranks.size(); ++k) j += str_cat(k ? ", " : "", c.world_ranks[k]);
    j += "]}";
  }
  j += "],\n \"ops\": [";
  for (size_t i = 0; i < recs.size(); ++i) {
    const CommOpRecord& r = recs[i];
    j += str_cat(i ? ",\n  " : "\n  ", "{\"id\": ", r.id, ", \"channel\": ", r.channel, ", \"kind\": \"",
                 comm_op_kind_name(r.kind), "\", \"seq\": ", r.seq, ", \"peer\": ", r.peer, ", \"tag\": ", r.tag,
                 ", \"bytes\": ", r.bytes, ", \"state\": \"", comm_op_state_name(r.state), "\", \"posted_s\": ",
                 seconds(r.posted_s), ", \"started_s\": ", seconds(r.started_s), ", \"completed_s\": ",
                 seconds(r.completed_s), "}");
  }
  return j + "]}\n";
}

std::string CommTrace::dump(const std::string& reason) {
  std::lock_guard<std::mutex> lk(dump_mu_);
  if (dumped_) return dump_path_;
  dumped_ = true;
  if (dir_.empty()) return "";
  try {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    const std::string path = str_cat(dir_, "/comm_trace.rank", world_rank_, ".json");
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << to_json(reason, now_seconds());
      if (!f.good()) return "";
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) return "";
    dump_path_ = path;
  } catch (...) {
    return "";
  }
  return dump_path_;
}

}  // namespace xirang
