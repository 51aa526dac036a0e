#include "comm/process_grid.h"

#include <mpi.h>

#include "comm/comm_trace.h"
#include "comm/mpi_check.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_runtime.h"
#include "core/error.h"

namespace xirang {

int grid_rank(const GridShape& s, const GridCoords& c) { return ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tp + c.tp; }

GridCoords grid_coords(const GridShape& s, int world_rank) {
  GridCoords c;
  c.tp = world_rank % s.tp;
  c.cp = (world_rank / s.tp) % s.cp;
  c.dp = (world_rank / (s.tp * s.cp)) % s.dp;
  c.pp = world_rank / (s.tp * s.cp * s.dp);
  return c;
}

std::vector<int> tp_group_ranks(const GridShape& s, const GridCoords& c) {
  std::vector<int> ranks(size_t(s.tp));
  GridCoords at = c;
  for (at.tp = 0; at.tp < s.tp; ++at.tp) ranks[size_t(at.tp)] = grid_rank(s, at);
  return ranks;
}

namespace {

class SingleGrid final : public ProcessGrid {
 public:
  SingleGrid()
      : world_("world"), dp_("dp"), tp_("tp"), pp_("pp"), cp_("cp"), dp_cp_("dp_cp"), dp_grads_("dp_grads"),
        embedding_("embedding"), ep_("ep"), expert_dp_("expert_dp") {}
  Communicator& world() override { return world_; }
  Communicator& dp() override { return dp_; }
  Communicator& tp() override { return tp_; }
  Communicator& pp() override { return pp_; }
  Communicator& cp() override { return cp_; }
  Communicator& dp_cp() override { return dp_cp_; }
  Communicator& dp_grads() override { return dp_grads_; }
  Communicator& embedding() override { return embedding_; }
  Communicator& ep() override { return ep_; }
  Communicator& expert_dp() override { return expert_dp_; }

 private:
  LocalCommunicator world_, dp_, tp_, pp_, cp_, dp_cp_, dp_grads_, embedding_, ep_, expert_dp_;
};

class MpiGrid final : public ProcessGrid {
 public:
  MpiGrid(const GridShape& shape, const CommOptions& opts, const LinkModel& link);
  ~MpiGrid() override;
  Communicator& world() override { return *world_; }
  Communicator& dp() override { return *dp_; }
  Communicator& tp() override { return *tp_; }
  Communicator& pp() override { return *pp_; }
  Communicator& cp() override { return *cp_; }
  Communicator& dp_cp() override { return *dp_cp_; }
  Communicator& dp_grads() override { return *dp_grads_; }
  Communicator& embedding() override { return *embedding_; }
  Communicator& ep() override { return *ep_; }
  Communicator& expert_dp() override { return expert_dp_ ? *expert_dp_ : *dp_grads_; }
  CommTrace* trace() override { return opts_.trace; }
  BusyPoll busy_poll() const override { return opts_.busy_poll; }

 private:
  std::unique_ptr<Communicator> make(MPI_Comm comm, const char* name);
  void release();  // destroys the communicators, then frees the split groups

  CommOptions opts_;
  LinkModel link_;
  std::unique_ptr<CommTrace> own_trace_;  // when opts.trace was null; outlives the communicators (declared first)
  // The split groups; each MpiCommunicator works on its own duplicate of one.
  MPI_Comm tp_comm_ = MPI_COMM_NULL, dp_comm_ = MPI_COMM_NULL, pp_comm_ = MPI_COMM_NULL;
  MPI_Comm cp_comm_ = MPI_COMM_NULL, dp_cp_comm_ = MPI_COMM_NULL, emb_comm_ = MPI_COMM_NULL;
  MPI_Comm ep_comm_ = MPI_COMM_NULL, expert_dp_comm_ = MPI_COMM_NULL;  // ep > 1 only
  std::unique_ptr<Communicator> world_, dp_, tp_, pp_, cp_, dp_cp_, dp_grads_, embedding_;
  // ep = 1: ep_ is a group of one and expert_dp_ is null (expert_dp() is dp_grads_).
  std::unique_ptr<Communicator> ep_, expert_dp_;
};

MPI_Comm split(int color, int key, int expected_rank, const char* group) {
  MPI_Comm c = MPI_COMM_NULL;
  XR_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &c));
  XR_MPI_CHECK(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
  int r = -1;
  XR_MPI_CHECK(MPI_Comm_rank(c, &r));
  XR_CHECK(r == expected_rank, "rank ", r, " in the ", group, " group after MPI_Comm_split, expected ", expected_rank);
  return c;
}

MpiGrid::MpiGrid(const GridShape& shape, const CommOptions& opts, const LinkModel& link) : opts_(opts), link_(link) {
  shape_ = shape;
  XR_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  coords_ = grid_coords(shape, world_rank_);
  if (!opts_.trace) {
    own_trace_ = std::make_unique<CommTrace>(world_rank_, shape.world(), opts_.trace_dir);
    opts_.trace = own_trace_.get();
  }
  const GridCoords& c = coords_;
  try {
    // Colors number the groups uniquely (each one the rank's coordinates
    // off the group's axes, as a mixed-radix number); keys order each group
    // by its index, so a rank's index in its group is its coordinate along
    // that axis (dp x cp: dp index, then cp index).
    const int dp = shape.dp, cp = shape.cp, tp = shape.tp;
    tp_comm_ = split((c.pp * dp + c.dp) * cp + c.cp, c.tp, c.tp, "tp");
    dp_comm_ = split((c.pp * cp + c.cp) * tp + c.tp, c.dp, c.dp, "dp");
    pp_comm_ = split((c.dp * cp + c.cp) * tp + c.tp, c.pp, c.pp, "pp");
    cp_comm_ = split((c.pp * dp + c.dp) * tp + c.tp, c.cp, c.cp, "cp");
    dp_cp_comm_ = split(c.pp * tp + c.tp, c.dp * cp + c.cp, c.dp * cp + c.cp, "dp x cp");
    // Every rank takes part in the split; middle stages get no group.
    const bool end_stage = shape.pp > 1 && (c.pp == 0 || c.pp == shape.pp - 1);
    XR_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, end_stage ? (c.dp * cp + c.cp) * tp + c.tp : MPI_UNDEFINED, c.pp,
                                &emb_comm_));
    if (emb_comm_ != MPI_COMM_NULL) XR_MPI_CHECK(MPI_Comm_set_errhandler(emb_comm_, MPI_ERRORS_RETURN));
    // ep = 1 makes no extra channel (no thread, no duplicate): runs without
    // experts keep the channels they had.
    const int ep = shape.ep, blocks = dp / ep, e = c.dp % ep, block = c.dp / ep;
    if (ep > 1) {
      ep_comm_ = split(((c.pp * blocks + block) * cp + c.cp) * tp + c.tp, e, e, "ep");
      expert_dp_comm_ = split((c.pp * tp + c.tp) * ep + e, block * cp + c.cp, block * cp + c.cp, "expert-dp");
    }
    // Every rank creates the communicators in the same order: each creation
    // duplicates an MPI communicator, a collective call over its group.
    world_ = make(MPI_COMM_WORLD, "world");
    tp_ = make(tp_comm_, "tp");
    dp_ = make(dp_comm_, "dp");
    pp_ = make(pp_comm_, "pp");
    cp_ = make(cp_comm_, "cp");
    dp_cp_ = make(dp_cp_comm_, "dp_cp");
    // Named "dp" in traces and timeouts as before cp: with cp = 1 it is dp's group.
    dp_grads_ = make(dp_cp_comm_, "dp");
    if (emb_comm_ != MPI_COMM_NULL) embedding_ = make(emb_comm_, "embedding");
    else embedding_ = std::make_unique<LocalCommunicator>("embedding");
    if (ep > 1) {
      ep_ = make(ep_comm_, "ep");
      expert_dp_ = make(expert_dp_comm_, "expert_dp");
    } else {
      ep_ = std::make_unique<LocalCommunicator>("ep");
    }
  } catch (...) {
    release();
    throw;
  }
}

MpiGrid::~MpiGrid() {
  release();
}

void MpiGrid::release() {
  // The communicators hold duplicates of the split groups and drain their
  // work on destruction, so they go first and the groups after.
  expert_dp_.reset();
  ep_.reset();
  embedding_.reset();
  dp_grads_.reset();
  dp_cp_.reset();
  cp_.reset();
  pp_.reset();
  dp_.reset();
  tp_.reset();
  world_.reset();
  if (!MpiRuntime::active()) return;
  // Return codes are ignored: a destructor cannot throw, and a failure to
  // free a communicator at shutdown changes nothing for the job.
  for (MPI_Comm* c : {&tp_comm_, &dp_comm_, &pp_comm_, &cp_comm_, &dp_cp_comm_, &emb_comm_, &ep_comm_, &expert_dp_comm_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

std::unique_ptr<Communicator> MpiGrid::make(MPI_Comm comm, const char* name) {
  std::unique_ptr<Communicator> c = std::make_unique<MpiCommunicator>(comm, name, opts_);
  if (link_.active()) c = std::make_unique<SimulatedLink>(std::move(c), link_, opts_.timeout_s);
  return c;
}

}  // namespace

std::unique_ptr<ProcessGrid> ProcessGrid::single() { return std::make_unique<SingleGrid>(); }

std::unique_ptr<ProcessGrid> ProcessGrid::create_mpi(const GridShape& shape, const CommOptions& opts,
                                                     const LinkModel& link) {
  if (!MpiRuntime::active())
    fail(ErrorKind::Comm, "ProcessGrid::create_mpi: MPI is not initialised (create an MpiRuntime first)");
  if (shape.dp < 1 || shape.cp < 1 || shape.tp < 1 || shape.pp < 1)
    fail(ErrorKind::Config, "parallel.dp x cp x tp x pp = ", shape.dp, " x ", shape.cp, " x ", shape.tp, " x ",
         shape.pp, ": every size must be at least 1");
  if (shape.ep < 1 || shape.dp % shape.ep != 0)
    fail(ErrorKind::Config, "parallel.ep = ", shape.ep, " must be at least 1 and divide parallel.dp = ", shape.dp,
         " (expert parallelism groups ep of the data-parallel ranks)");
  int world = 0;
  XR_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  if (world != shape.world())
    fail(ErrorKind::Config, "world size ", world, " does not match parallel.dp x cp x tp x pp = ", shape.dp, " x ",
         shape.cp, " x ", shape.tp, " x ", shape.pp, " = ", shape.world());
  CommOptions o = opts;
  // Per node: a rank's polls compete only with its own node's threads.
  if (o.busy_poll == BusyPoll::Auto)
    o.busy_poll = world_node_layout(o.compute_threads).crowded() ? BusyPoll::Off : BusyPoll::On;
  return std::make_unique<MpiGrid>(shape, o, link);
}

}  // namespace xirang
