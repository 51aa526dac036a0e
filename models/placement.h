// models/placement.h: which layers a pipeline chunk holds, and which chunks
// a pipeline rank holds. The trainer, the schedules, the checkpoint
// converter and the performance model all place chunks with these.
//
//   const ChunkMap map{pp, virtual_stages, ChunkOrder::RoundRobin};
//   int g = map.model_chunk(pp_rank, c);                                 // local chunk c
//   ChunkPlacement at = map.placement(n_layer, pp_rank, c);
#pragma once

#include "core/error.h"

namespace xirang {

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

// How the p x v model chunks are dealt to the p pipeline ranks.
// RoundRobin: chunk g on rank g % p as its local chunk g / p (the
// interleaved schedule's assignment; one chunk per rank: chunk = rank).
// V (zb_v, two chunks per rank): rank r holds chunks r and 2p - 1 - r, so
// the forward runs down the ranks and back up; rank 0 holds the first and
// the last chunk, and rank p - 1 hands chunk p - 1's output to chunk p
// without a transfer.
enum class ChunkOrder { RoundRobin, V };

// The one map from model chunks to (pipeline rank, local chunk): the
// trainer, the executor, the memory estimate, the checkpoint converter and
// the schedules all place chunks with it.
struct ChunkMap {
  int p = 1, v = 1;
  ChunkOrder order = ChunkOrder::RoundRobin;

  int chunks() const { return p * v; }
  int model_chunk(int rank, int local) const {
    XR_CHECK(0 <= rank && rank < p && 0 <= local && local < v, "pipeline chunk map: rank ", rank, " of ", p,
             ", local chunk ", local, " of ", v);
    if (order == ChunkOrder::V) return local == 0 ? rank : 2 * p - 1 - rank;
    return local * p + rank;
  }
  int rank_of(int g) const {
    check(g);
    return order == ChunkOrder::V ? (g < p ? g : 2 * p - 1 - g) : g % p;
  }
  int local_of(int g) const {
    check(g);
    return order == ChunkOrder::V ? (g < p ? 0 : 1) : g / p;
  }
  // The layers of rank `rank`'s local chunk `local` out of n_layer.
  ChunkPlacement placement(int n_layer, int rank, int local) const {
    return ChunkPlacement::of_chunk(n_layer, chunks(), model_chunk(rank, local));
  }

 private:
  void check(int g) const {
    XR_CHECK(0 <= g && g < chunks(), "pipeline chunk map: model chunk ", g, " of ", chunks());
    XR_CHECK(order != ChunkOrder::V || v == 2, "pipeline chunk map: a V has 2 chunks per rank, not ", v);
  }
};

}  // namespace xirang
