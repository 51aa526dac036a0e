// kernels/context_split.h: how context parallelism cuts a sequence over the
// ranks of a cp group, and where each of a rank's rows sits in it.
//
// A sequence of T = 2 c L tokens is cut into 2c chunks of L. Head-tail (the
// default, Llama 3's assignment) gives rank i chunks i and 2c-1-i, so every
// rank does the same causal attention work: (2i+1) + (4c-2i-1) = 4c chunk
// pairs. Contiguous gives rank i chunks 2i and 2i+1 (rank i's work grows as
// 4i+2: the busiest does (2c-1)/c of the mean; kept to measure the imbalance).
// A rank's local rows are its two chunks, lower chunk first: local row t of
// 2L sits at global position position(rank, t). One rank (c = 1) is the
// whole sequence in order, for any T.
//
//   ContextSplit split = ContextSplit::of(T, cp);      // T % (2 cp) == 0 when cp > 1
//   int64_t p = split.position(rank, t);               // t in [0, split.local_rows())
//   int owner; int64_t row = split.local_row(p, &owner);
#pragma once

#include <cstdint>

// The index arithmetic runs on the host and in CUDA kernels alike.
#ifdef __CUDACC__
#define XR_SPLIT_HD __host__ __device__
#else
#define XR_SPLIT_HD
#endif

namespace xirang {

struct ContextSplit {
  int ranks = 1;           // c, the cp group's size
  int64_t seq_len = 0;     // T, the whole sequence
  bool head_tail = true;   // rank i holds chunks i and 2c-1-i; false: 2i and 2i+1

  static ContextSplit of(int64_t seq_len, int ranks, bool head_tail = true) { return {ranks, seq_len, head_tail}; }
  static ContextSplit whole(int64_t seq_len) { return {1, seq_len, true}; }

  // L: tokens in a chunk (T itself when c = 1).
  XR_SPLIT_HD int64_t chunk() const { return ranks == 1 ? seq_len : seq_len / (2 * ranks); }
  // Rows each rank holds: T / c.
  XR_SPLIT_HD int64_t local_rows() const { return ranks == 1 ? seq_len : 2 * chunk(); }
  // The global chunk index of a rank's lower (part 0) or upper (part 1) chunk.
  XR_SPLIT_HD int64_t chunk_of(int rank, int part) const {
    if (head_tail) return part == 0 ? rank : 2 * int64_t(ranks) - 1 - rank;
    return 2 * int64_t(rank) + part;
  }
  // The global position of `rank`'s local row t.
  XR_SPLIT_HD int64_t position(int rank, int64_t t) const {
    if (ranks == 1) return t;
    const int64_t L = chunk();
    return chunk_of(rank, int(t / L)) * L + t % L;
  }
  // The inverse: the local row that holds global position p, its rank in *owner.
  XR_SPLIT_HD int64_t local_row(int64_t p, int* owner) const {
    if (ranks == 1) {
      *owner = 0;
      return p;
    }
    const int64_t L = chunk(), g = p / L, c2 = 2 * int64_t(ranks);
    if (head_tail) {
      *owner = int(g < ranks ? g : c2 - 1 - g);
      return (g < ranks ? 0 : L) + p % L;
    }
    *owner = int(g / 2);
    return (g % 2) * L + p % L;
  }
};

}  // namespace xirang
