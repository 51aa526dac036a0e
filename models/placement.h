// models/placement.h: which layers a pipeline chunk holds, and which chunks
// a pipeline rank holds. The trainer, the schedules, the checkpoint
// converter and the performance model all place chunks with these.
//
//   int g = model_chunk(pp, pp_rank, c);                                 // local chunk c
//   ChunkPlacement at = ChunkPlacement::of_chunk(n_layer, pp * virtual_stages, g);
#pragma once

namespace xirang {

// Model chunk g of pipeline rank `rank`'s local chunk c: chunks are dealt
// to the ranks round-robin (the interleaved schedule's assignment; with one
// chunk per rank, chunk = rank).
inline int model_chunk(int p, int rank, int chunk) { return chunk * p + rank; }

// The part of the model one pipeline chunk holds.
struct ChunkPlacement {
  int first_layer = 0;
  int end_layer = 0;  // exclusive
  bool has_embedding = true;
  bool has_head = true;
  static ChunkPlacement whole(int n_layer) { return {0, n_layer, true, true}; }
  // Model chunk g of `chunks` (= pp x virtual stages): an equal share of
  // the layers (check_layout requires n_layer % chunks == 0); the first
  // chunk holds the embedding, the last the final norm and the head.
  static ChunkPlacement of_chunk(int n_layer, int chunks, int g) {
    const int per_chunk = n_layer / chunks;
    return {g * per_chunk, (g + 1) * per_chunk, g == 0, g == chunks - 1};
  }
};

}  // namespace xirang
