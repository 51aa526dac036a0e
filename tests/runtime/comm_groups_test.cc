// Tests of runtime/comm_groups.h that need no MPI and no GPU: on the CPU the
// layers get the grid's own groups, expert parallelism's included.
#include <gtest/gtest.h>

#include "comm/process_grid.h"
#include "runtime/comm_groups.h"

namespace xirang {
namespace {

TEST(CommGroups, ExpertGroupsAreTheGridsOnTheCpu) {
  auto grid = ProcessGrid::single();
  Config cfg;
  CommGroups comm(cfg, *grid, DType::F32);
  EXPECT_EQ(comm.device(), Device::CPU);
  EXPECT_EQ(&comm.ep(), &grid->ep());
  EXPECT_EQ(&comm.expert_dp(), &grid->expert_dp());
  EXPECT_EQ(&comm.dp_grads(), &grid->dp_grads());
  EXPECT_EQ(comm.ep().name(), "ep");
  EXPECT_EQ(comm.expert_dp().name(), "expert_dp");
}

}  // namespace
}  // namespace xirang
