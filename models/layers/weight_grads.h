// models/layers/weight_grads.h: a backward pass split in two, for the
// zero-bubble pipeline schedules (ZB-H1, ZB-V).
//
// The input-gradient pass (B) runs what the previous stage waits for: each
// layer's input-gradient product, bias and norm gradients, and the
// reductions between them. It leaves each weight-gradient product dW +=
// dY^T X to a WeightGradQueue, with its operands: a tensor of the
// microbatch's input slot (the layer inputs its forward kept for W; the
// slot is not reused before the weight-gradient pass) is referenced, any
// other (backward scratch, the residual gradient, a sequence-parallel
// gather, a recomputed activation) is copied into the queue's own storage
// in stream order, so that the microbatch's activation slot is free once
// B has run. The weight-gradient pass
// (W) runs the products in the order B queued them, and after each layer's
// last one the layer's gradient-ready mark (the dp buckets' hook). The
// products are the same kernel calls with the same operands as the fused
// backward's (kernels/matmul.h: dx, dw and dbias are computed
// independently), so B then W gives bitwise the fused backward's gradients.
//
//   WeightGradQueue q;
//   q.bind(storage, input_slot_begin, input_slot_end);     // at each B, before its products
//   linear.backward(ctx, dx, dy, x, &q);                   // B: dx now, dW queued
//   q.layer_done(l);                                        // where the fused pass calls grad_ready(l)
//   q.run(ctx, [&](int l) { grad_ready(l); });              // W
#pragma once

#include <functional>
#include <vector>

#include "kernels/context.h"

namespace xirang {

class WeightGradQueue {
 public:
  // `storage`: bytes for copied operands (any dtype, 256-byte aligned
  // pieces); [own_begin, own_end): the microbatch's input slot, referenced
  // without a copy. Forgets what was queued.
  void bind(Tensor storage, const void* own_begin, const void* own_end);
  // Bytes of storage for `tensors` copied (the 256-byte alignment included).
  static int64_t bytes_for(const std::vector<int64_t>& tensor_bytes);

  // `t` itself when it lies in the slot, else a copy in the queue's storage.
  Tensor keep(const KernelContext& ctx, const Tensor& t);
  // dw += dy^T x later (kernels/matmul.h linear_backward with dw only).
  void product(const KernelContext& ctx, Tensor dw, const Tensor& w, const Tensor& dy, const Tensor& x);
  // The fused pass's grad_ready(layer) point.
  void layer_done(int layer);
  // W: runs everything queued since the last run, in order, calling `ready(layer)` at each mark.
  void run(const KernelContext& ctx, const std::function<void(int)>& ready);
  bool pending() const { return !entries_.empty(); }

 private:
  struct Entry {
    enum Kind { Product, Done } kind;
    Tensor dw, w, dy, x;
    int layer = 0;
  };
  std::vector<Entry> entries_;
  Tensor storage_;
  int64_t capacity_ = 0, used_ = 0;
  const char* own_begin_ = nullptr;
  const char* own_end_ = nullptr;
};

}  // namespace xirang
