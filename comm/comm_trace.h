// comm/comm_trace.h: a rank's recent communication operations, for finding
// which rank a hung job waits for.
//
// One CommTrace per process, shared by its channels (the MPI communicators
// of a ProcessGrid). It keeps the last `capacity` operations in a ring
// allocated once: the kind, the channel (group), the peer and tag of a
// point-to-point operation, a sequence number, the bytes, when it was
// posted, started and completed, and its state. A collective's sequence
// number counts the collectives of its channel, so the same operation has
// the same number on every rank of the group; point-to-point operations
// count separately. Recording takes a short lock and no allocation.
//
// When an operation times out, the channel calls dump(): the ring goes to
// DIR/comm_trace.rank<N>.json (once per process). A rank that hangs outside
// communication never times out and writes nothing; `xirang diagnose DIR`
// compares the ranks' dumps and names the rank that is behind
// (tools/diagnose_cmd.cc).
//
//   CommTrace trace(world_rank, world_size, "runs/x");
//   int ch = trace.add_channel("dp", group_rank, {0, 2});  // the group's world ranks
//   uint64_t id = trace.posted(ch, CommOpKind::AllReduce, -1, -1, bytes, seq);
//   trace.started(id, now_seconds());
//   trace.completed(id, true, now_seconds());
//   std::string path = trace.dump("dp all_reduce #7 of 4096 bytes did not complete within 60 s");
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace xirang {

// AllToAllV records the bytes this rank sends (its recv side may differ).
enum class CommOpKind : uint8_t { AllReduce, ReduceScatter, AllGather, Broadcast, Barrier, Send, Recv, AllToAllV };
enum class CommOpState : uint8_t { Posted, InFlight, Done, Failed };

const char* comm_op_kind_name(CommOpKind k);    // "all_reduce", "send", ...
const char* comm_op_state_name(CommOpState s);  // "posted", "in_flight", "done", "failed"
inline bool is_collective(CommOpKind k) { return k != CommOpKind::Send && k != CommOpKind::Recv; }

struct CommOpRecord {
  uint64_t id = 0;   // 1, 2, ... in posting order over all channels of the process; 0: an empty slot
  int channel = -1;  // CommTrace::add_channel's index
  CommOpKind kind = CommOpKind::AllReduce;
  CommOpState state = CommOpState::Posted;
  int peer = -1;     // point-to-point: the peer's rank in the group; -1 for collectives
  int tag = -1;      // point-to-point: the tag
  uint64_t seq = 0;  // the channel's count of its collectives (or of its point-to-point operations), from 1
  int64_t bytes = 0;
  double posted_s = 0, started_s = 0, completed_s = 0;  // core/clock.h now_seconds(); 0: not yet
};

// A channel as the dump describes it.
struct CommChannel {
  std::string group;            // "dp", "tp", "pp", "world", "embedding"
  int instance = 0;             // 0, 1, ... among this process's channels of the same group (dp has two)
  int rank = 0;                 // this process's rank in the group
  std::vector<int> world_ranks;  // the group's members by group rank
};

class CommTrace {
 public:
  static constexpr size_t kDefaultCapacity = 256;
  // `dump_dir` empty: dump() writes nothing.
  CommTrace(int world_rank, int world_size, std::string dump_dir, size_t capacity = kDefaultCapacity);
  CommTrace(const CommTrace&) = delete;
  CommTrace& operator=(const CommTrace&) = delete;

  int add_channel(const std::string& group, int rank, std::vector<int> world_ranks);
  // Records a new operation (state posted); returns its id for started()/completed().
  uint64_t posted(int channel, CommOpKind kind, int peer, int tag, int64_t bytes, uint64_t seq, double now_s);
  // Updates the operation if the ring still holds it (a newer one may have taken its slot).
  void started(uint64_t id, double now_s);
  void completed(uint64_t id, bool ok, double now_s);

  std::vector<CommOpRecord> records() const;  // oldest first
  std::vector<CommChannel> channels() const;
  int world_rank() const { return world_rank_; }
  const std::string& dump_dir() const { return dir_; }
  // The JSON document dump() writes ("xirang-comm-trace-1").
  std::string to_json(const std::string& reason, double now_s) const;
  // Writes DIR/comm_trace.rank<N>.json the first time it is called (later
  // calls return the same path without writing); "" without a directory or
  // when the file cannot be written (a dump never throws: it runs while
  // another failure is being reported).
  std::string dump(const std::string& reason);

 private:
  CommOpRecord* slot(uint64_t id);  // null when the ring no longer holds `id`

  int world_rank_, world_size_;
  std::string dir_;
  mutable std::mutex mu_;
  std::vector<CommOpRecord> ring_;  // capacity slots; id i lives in slot (i - 1) % capacity
  uint64_t next_id_ = 1;
  std::vector<CommChannel> channels_;
  std::mutex dump_mu_;
  bool dumped_ = false;
  std::string dump_path_;
};

}  // namespace xirang
