// kernels/group_table.h: device memory for the chunk table of a grouped op.
//
// The grouped ops (adamw_update_group in kernels/adamw.h, sum_squares_group
// in kernels/elementwise.h) run over many tensors in one launch on CUDA:
// the tensors are cut into chunks of at most kGroupChunk elements, one
// thread block per chunk, and each block reads its chunk's record (pointers,
// element count, flags) from a table in device memory. The caller carves
// that memory once, sized for the most tensors and elements the group will
// hold, from an arena (so the memory plan counts it); the op writes the
// table on its first call and again only when the list of tensors changes.
// On the CPU the table is not used.
//
//   GroupTable table(state.alloc({group_table_words(count, elements)}, DType::U32, "AdamW chunk table"));
//   adamw_update_group(ctx, tensors, step, table);   // every step
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace xirang {

// Elements per chunk: 128 per thread of a 256-thread block.
constexpr int64_t kGroupChunk = int64_t(1) << 15;
// Bytes of table per chunk: the largest record of any grouped op, with room
// for a per-chunk partial sum.
constexpr int64_t kGroupRecordBytes = 64;

// The most chunks `tensors` tensors of `elements` elements in all can make:
// each tensor adds at most one partial chunk.
inline int64_t group_chunk_bound(int64_t tensors, int64_t elements) { return elements / kGroupChunk + tensors; }

// U32 words of table memory for a group of at most `tensors` tensors and
// `elements` elements in all (256 bytes more, for an op's aligned second region).
inline int64_t group_table_words(int64_t tensors, int64_t elements) {
  return (group_chunk_bound(tensors, elements) * kGroupRecordBytes + 256) / 4;
}

struct GroupTable {
  GroupTable() = default;
  explicit GroupTable(Tensor mem) : memory(mem) {}
  Tensor memory;               // (group_table_words) U32 on the tensors' device
  std::vector<uint64_t> key;   // what the table holds now (op-defined; empty: nothing written)
  int64_t chunks = 0;          // records written
};

}  // namespace xirang
