// Tests for core/arena.h: Arena carving and alignment, measuring mode, the
// out-of-space error, MemoryPlan and format_bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "tests/support/expect_error.h"

namespace xirang {
namespace {

// One carving sequence with odd sizes, run against both kinds of arena.
void carve(Arena& a, std::vector<Tensor>* out) {
  out->push_back(a.alloc({37, 48}, DType::F32, "ln1"));
  out->push_back(a.alloc({3}, DType::BF16, "tiny"));
  out->push_back(a.alloc({13, 13, 3}, DType::F64, "probs"));
  out->push_back(a.alloc({0}, DType::F32, "empty"));
  out->push_back(a.alloc({129}, DType::I32, "tokens"));
}

TEST(Arena, AllocationsAre256ByteAlignedAndDisjoint) {
  Arena a("acts", 1 << 20);
  std::vector<Tensor> ts;
  carve(a, &ts);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.base()) % Arena::kAlignment, 0u);
  for (auto& t : ts) EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % Arena::kAlignment, 0u) << t.str();
  // Each tensor starts at or after the end of the previous one.
  for (size_t i = 1; i < ts.size(); ++i)
    EXPECT_GE(static_cast<char*>(ts[i].raw()), static_cast<char*>(ts[i - 1].raw()) + ts[i - 1].bytes());
  EXPECT_EQ(ts[0].shape(), (Shape{37, 48}));
  EXPECT_EQ(ts[2].dtype(), DType::F64);
  EXPECT_EQ(a.used() % Arena::kAlignment, 0u);
}

TEST(Arena, MemoryIsWritable) {
  Arena a("params", 4096);
  Tensor t = a.alloc({100}, DType::F32, "w");
  float* p = t.data<float>();
  for (int i = 0; i < 100; ++i) p[i] = float(i);
  EXPECT_EQ(p[99], 99.0f);
}

// Sizing runs the same carving code twice; the measured byte count must be
// exactly what the real arena then uses, so a plan never under-sizes.
TEST(Arena, MeasuringCountsTheSameBytes) {
  Arena probe = Arena::measuring("acts");
  EXPECT_TRUE(probe.is_measuring());
  std::vector<Tensor> ignored;
  carve(probe, &ignored);
  // Sum of sizes rounded up to 256 each: 7168 + 256 + 4096 + 0 + 768.
  EXPECT_EQ(probe.used(), 7168u + 256u + 4096u + 0u + 768u);
  Arena real("acts", probe.used());
  std::vector<Tensor> ts;
  carve(real, &ts);  // fits exactly: no throw
  EXPECT_EQ(real.used(), probe.used());
  EXPECT_EQ(real.capacity(), probe.used());
}

TEST(Arena, OutOfSpaceNamesArenaAndItem) {
  Arena a("activations", 1024);
  a.alloc({200}, DType::F32, "ln1_out");  // 800 -> 1024 bytes, full
  expect_error([&] { a.alloc({1}, DType::F32, "attn_probs"); }, ErrorKind::Memory, {"activations", "attn_probs"});
}

TEST(Arena, ResetReusesMemory) {
  Arena a("ws", 1024);
  Tensor t1 = a.alloc({256}, DType::F32, "a");
  a.reset();
  EXPECT_EQ(a.used(), 0u);
  Tensor t2 = a.alloc({256}, DType::F32, "b");
  EXPECT_EQ(t1.raw(), t2.raw());
}

TEST(Arena, MoveTransfersOwnership) {
  Arena a("p", 512);
  void* base = a.base();
  a.alloc({10}, DType::F32, "x");
  Arena b(std::move(a));
  EXPECT_EQ(b.base(), base);
  EXPECT_EQ(b.used(), 256u);
  EXPECT_EQ(b.name(), "p");
}

// ---------------------------------------------------------------- MemoryPlan

TEST(MemoryPlan, AddsMergesAndTotals) {
  MemoryPlan plan;
  plan.add("parameters", 1000, "250 x f32");
  plan.add("gradients", 1000);
  plan.add("parameters", 24, "6 x f32");  // same category merges
  EXPECT_EQ(plan.items().size(), 2u);
  EXPECT_EQ(plan.bytes_of("parameters"), 1024u);
  EXPECT_EQ(plan.bytes_of("activations"), 0u);
  EXPECT_EQ(plan.total(), 2024u);
  EXPECT_EQ(plan.items()[0].detail, "250 x f32; 6 x f32");
}

TEST(MemoryPlan, TableHasOneLinePerCategoryAndATotal) {
  MemoryPlan plan;
  plan.add("parameters", 3 << 20, "786K x f32");
  plan.add("activations", 1536);
  std::string t = plan.table("memory plan (rank 0)");
  EXPECT_EQ(t.rfind("memory plan (rank 0)\n", 0), 0u) << t;
  EXPECT_NE(t.find("parameters"), std::string::npos) << t;
  EXPECT_NE(t.find("3.00 MiB"), std::string::npos) << t;
  EXPECT_NE(t.find("786K x f32"), std::string::npos) << t;
  EXPECT_NE(t.find("1.50 KiB"), std::string::npos) << t;
  EXPECT_NE(t.find("total"), std::string::npos) << t;
  EXPECT_EQ(std::count(t.begin(), t.end(), '\n'), 4) << t;  // title, 2 items, total
}

// Over the limit: one Memory error naming the total, the limit, its key and
// the largest item, so the user knows what to change.
TEST(MemoryPlan, CheckLimitMessage) {
  MemoryPlan plan;
  plan.add("parameters", 1 << 20);
  plan.add("activations", 3 << 20);
  EXPECT_NO_THROW(plan.check_limit(4 << 20, "device.memory_limit"));  // exactly at the limit fits
  EXPECT_NO_THROW(plan.check_limit(0, "device.memory_limit"));        // 0 means no limit
  expect_error([&] { plan.check_limit(2 << 20, "device.memory_limit"); }, ErrorKind::Memory,
               {"4.00 MiB", "2.00 MiB", "device.memory_limit", "activations", "3.00 MiB"});
}

TEST(MemoryPlan, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(size_t(5) << 30), "5.00 GiB");
  EXPECT_EQ(format_bytes((size_t(1) << 40) + (size_t(1) << 39)), "1.50 TiB");
}

}  // namespace
}  // namespace xirang
