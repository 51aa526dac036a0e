// core/rng.h: counter-based random numbers (Philox-4x32-10).
//
// A random value is a pure function of (seed, stream, index): no generator
// state advances, so any rank can produce exactly the slice of a tensor it
// owns. Parameters use stream = hash of their name and index = the global
// element index, which makes a tensor- or pipeline-parallel shard equal to
// the same slice of the single-rank model whatever the layout.
//
//   uint64_t s = name_stream("h.0.attn.c_attn.weight");
//   double w = 0.02 * rng_normal(seed, s, global_index);
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace xirang {

// One Philox-4x32-10 block: 4 random 32-bit words for a 128-bit counter under a 64-bit key.
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo);

// A stable 64-bit stream id for a name (FNV-1a, then mixed).
uint64_t name_stream(std::string_view name);

// Uniform in the open interval (0, 1), 53-bit resolution.
double rng_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal (Box-Muller over one Philox block).
double rng_normal(uint64_t seed, uint64_t stream, uint64_t index);
// Uniform integer in [0, n).
uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n);

}  // namespace xirang
