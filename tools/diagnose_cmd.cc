// xirang diagnose DIR
//
// Reads the comm_trace.rank<N>.json files that ranks write when a
// communication operation times out (comm/comm_trace.h) and names the rank
// that the others wait for. A collective has the same sequence number on
// every rank of its group, so a rank that never posted the number the
// others wait in is behind; a rank with no file never timed out itself,
// which in a hung job means it is stuck outside communication (or dead). A
// point-to-point operation still waiting names its peer.
//
// One line per finding, then a summary line:
//   dp (world ranks 0 1 2): ranks 0 2 wait in all_reduce #5 (49152 bytes, 8.0 s); rank 1 wrote no trace
//   summary: rank 1 is behind: ranks 0 2 wait for it in dp all_reduce #5; it wrote no trace, ...
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "tools/commands.h"

namespace xirang::tools {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Op {
  int channel = -1;
  std::string kind, state;
  uint64_t seq = 0;
  int peer = -1, tag = -1;
  int64_t bytes = 0;
  double started_s = 0, posted_s = 0;
  bool collective() const { return kind != "send" && kind != "recv"; }
  bool pending() const { return state == "posted" || state == "in_flight"; }
};

struct Channel {
  std::string group;
  int instance = 0;
  std::vector<int> world_ranks;
  std::string key() const {
    std::string k = group + "#" + std::to_string(instance) + ":";
    for (int r : world_ranks) k += std::to_string(r) + ",";
    return k;
  }
};

struct Dump {
  int rank = -1, world_size = 0;
  double time_s = 0;
  std::string path, reason;
  std::vector<Channel> channels;
  std::vector<Op> ops;
};

Dump read_dump(const fs::path& p) {
  std::ifstream f(p);
  json j;
  try {
    j = json::parse(f);
    Dump d;
    d.path = p.string();
    if (j.at("format").get<std::string>() != "xirang-comm-trace-1") throw std::runtime_error("unknown format");
    d.rank = j.at("rank").get<int>();
    d.world_size = j.at("world_size").get<int>();
    d.time_s = j.at("time_s").get<double>();
    d.reason = j.at("reason").get<std::string>();
    for (const json& c : j.at("channels"))
      d.channels.push_back({c.at("group").get<std::string>(), c.at("instance").get<int>(),
                            c.at("world_ranks").get<std::vector<int>>()});
    for (const json& o : j.at("ops")) {
      Op op;
      op.channel = o.at("channel").get<int>();
      op.kind = o.at("kind").get<std::string>();
      op.state = o.at("state").get<std::string>();
      op.seq = o.at("seq").get<uint64_t>();
      op.peer = o.at("peer").get<int>();
      op.tag = o.at("tag").get<int>();
      op.bytes = o.at("bytes").get<int64_t>();
      op.posted_s = o.at("posted_s").get<double>();
      op.started_s = o.at("started_s").get<double>();
      if (op.channel < 0 || op.channel >= int(d.channels.size())) throw std::runtime_error("channel out of range");
      d.ops.push_back(op);
    }
    if (d.rank < 0 || d.rank >= d.world_size) throw std::runtime_error("rank out of range");
    return d;
  } catch (const std::exception& e) {
    fail(ErrorKind::Data, "diagnose: ", p.string(), " is not a comm trace (", e.what(), ")");
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) {
    if (!s.empty()) s += ' ';
    s += std::to_string(r);
  }
  return s;
}

std::string ranks_word(const std::vector<int>& ranks) {
  return str_cat(ranks.size() == 1 ? "rank " : "ranks ", rank_list(ranks));
}

std::string seconds_str(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

// How long the op had waited when its rank dumped.
double waited(const Dump& d, const Op& op) { return d.time_s - (op.started_s > 0 ? op.started_s : op.posted_s); }

}  // namespace

int diagnose_command(int argc, char** argv) {
  if (argc != 2 || argv[1][0] == '-') {
    std::printf("usage: xirang diagnose DIR   (DIR holds the comm_trace.rank<N>.json files of a timed-out run)\n");
    return argc == 2 && (!std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) ? 0 : 2;
  }
  const fs::path dir = argv[1];
  if (!fs::is_directory(dir)) fail(ErrorKind::Usage, "diagnose: '", dir.string(), "' is not a directory");
  std::map<int, Dump> dumps;
  const std::regex name("comm_trace\\.rank([0-9]+)\\.json");
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string fn = e.path().filename().string();
    if (!std::regex_match(fn, m, name)) continue;
    Dump d = read_dump(e.path());
    if (d.rank != std::stoi(m[1].str()))
      fail(ErrorKind::Data, "diagnose: ", fn, " holds the trace of rank ", d.rank);
    dumps.emplace(d.rank, std::move(d));
  }
  if (dumps.empty())
    fail(ErrorKind::Data, "diagnose: no comm_trace.rank<N>.json in ", dir.string(),
         " (a rank writes one when a communication operation times out; see comm.trace_dir)");
  int world = 0;
  for (auto& [r, d] : dumps) world = std::max(world, d.world_size);
  std::vector<int> silent;  // ranks without a trace
  for (int r = 0; r < world; ++r)
    if (!dumps.count(r)) silent.push_back(r);
  std::printf("traces: %zu of %d ranks (%s)%s\n", dumps.size(), world, [&] {
    std::vector<int> v;
    for (auto& [r, d] : dumps) v.push_back(r);
    return rank_list(v);
  }().c_str(), silent.empty() ? "" : str_cat("; none from ", ranks_word(silent)).c_str());

  // Each channel (by group, instance and members) as every rank that dumped it saw it.
  std::map<std::string, Channel> channels;
  std::map<std::string, std::map<int, int>> index;  // key -> world rank -> channel index in its dump
  for (auto& [r, d] : dumps)
    for (size_t i = 0; i < d.channels.size(); ++i) {
      channels.emplace(d.channels[i].key(), d.channels[i]);
      index[d.channels[i].key()][r] = int(i);
    }

  std::map<int, int> blamed;  // world rank -> findings that name it behind
  std::map<int, std::string> note;  // world rank -> the first finding that names it, as "who waits where"
  for (auto& [key, ch] : channels) {
    // The last collective each member posted on this channel.
    std::map<int, const Op*> last;
    for (auto& [r, ci] : index[key]) {
      const Op* l = nullptr;
      for (const Op& op : dumps[r].ops)
        if (op.channel == ci && op.collective() && (!l || op.seq > l->seq)) l = &op;
      last[r] = l;
    }
    uint64_t top = 0;
    const Op* waiting_op = nullptr;
    for (auto& [r, l] : last)
      if (l && l->pending() && l->seq >= top) top = l->seq, waiting_op = l;
    if (!waiting_op) continue;
    std::vector<int> waiting, behind, no_trace;
    double longest = 0;
    std::string behind_detail;
    for (int w : ch.world_ranks) {
      if (!dumps.count(w)) {
        no_trace.push_back(w);
        continue;
      }
      const Op* l = last.count(w) ? last[w] : nullptr;
      if (l && l->seq == top && l->pending()) {
        waiting.push_back(w);
        longest = std::max(longest, waited(dumps[w], *l));
      } else if (!l || l->seq < top) {
        behind.push_back(w);
        behind_detail += str_cat("; rank ", w, "'s last is ",
                                 l ? str_cat(l->kind, " #", l->seq, " (", l->state, ")") : std::string("none"));
      }
    }
    std::string line = str_cat(ch.group, " (world ranks ", rank_list(ch.world_ranks), "): ", ranks_word(waiting),
                               " wait in ", waiting_op->kind, " #", top, " (", waiting_op->bytes, " bytes, ",
                               seconds_str(longest), ")");
    if (!behind.empty()) line += str_cat("; ", ranks_word(behind), " never posted it", behind_detail);
    if (!no_trace.empty())
      line += str_cat("; ", ranks_word(no_trace), " wrote no trace (never timed out: stuck outside communication, or dead)");
    if (behind.empty() && no_trace.empty()) line += "; every rank posted it and none completed it (the network or MPI)";
    std::printf("%s\n", line.c_str());
    const std::string where = str_cat(ranks_word(waiting), " wait for it in ", ch.group, " ", waiting_op->kind, " #", top);
    for (const auto* group : {&behind, &no_trace})
      for (int w : *group) {
        ++blamed[w];
        note.emplace(w, where);
      }
  }
  // Point-to-point operations still waiting: their peer is the suspect.
  for (auto& [r, d] : dumps)
    for (const Op& op : d.ops) {
      if (op.collective() || !op.pending()) continue;
      const Channel& ch = d.channels[size_t(op.channel)];
      if (op.peer < 0 || op.peer >= int(ch.world_ranks.size())) continue;
      const int peer = ch.world_ranks[size_t(op.peer)];
      std::string line = str_cat(ch.group, ": rank ", r, " waits in ", op.kind, " ", op.kind == "recv" ? "from" : "to",
                                 " rank ", peer, " (tag ", op.tag, ", ", op.bytes, " bytes, ", seconds_str(waited(d, op)),
                                 ")");
      if (!dumps.count(peer)) line += str_cat("; rank ", peer, " wrote no trace");
      std::printf("%s\n", line.c_str());
      ++blamed[peer];
      note.emplace(peer, str_cat("rank ", r, " waits for it in ", ch.group, " ", op.kind, " (tag ", op.tag, ")"));
    }
  // Ranks named most often first; ranks without a trace before those with one.
  std::vector<std::pair<int, int>> order(blamed.begin(), blamed.end());
  std::stable_sort(order.begin(), order.end(), [&](auto& a, auto& b) {
    const bool sa = !dumps.count(a.first), sb = !dumps.count(b.first);
    return sa != sb ? sa : a.second > b.second;
  });
  if (order.empty()) {
    std::printf("summary: no rank is behind in these traces\n");
    return 0;
  }
  const int suspect = order.front().first;
  std::string also;
  for (size_t i = 1; i < order.size(); ++i) {
    if (!also.empty()) also += ' ';
    also += std::to_string(order[i].first);
  }
  std::printf("summary: rank %d is behind: %s; %s%s\n", suspect, note[suspect].c_str(),
              dumps.count(suspect) ? "its own trace shows where it stopped"
                                   : "it wrote no trace, so it never timed out: it is stuck outside communication "
                                     "(compute, I/O, a hang) or dead",
              also.empty() ? "" : str_cat(" (also named: ", also, ")").c_str());
  return 0;
}

}  // namespace xirang::tools
