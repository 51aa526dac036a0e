// tests/runtime/step/affine_chunk.h: a model chunk whose passes are cheap
// affine maps, for the pipeline executor's and GradSync's tests.
//
// The model, in float64 on (R = B*T, C) activations:
//   first chunk:  h[r][c] = emb[c] * (1 + tokens[r])
//   layer l:      h[r][c] <- h[r][c] * w.l[c] + b.l[c]
//   last chunk:   loss = mean_r (1 + targets[r]) * sum_c h[r][c] * head[c]
// Every element's arithmetic is the same however the layers are cut into
// chunks, and each gradient accumulates over microbatches in microbatch
// order, so a pipelined step's losses and gradients equal a one-rank run's
// bitwise. Parameters are in forward order: emb (layer -1), w.l and b.l
// (layer l), head (layer n_layer).
//
// The data carry their microbatch: the feed writes the microbatch number
// into tokens[0] and targets[0], and each activation and activation
// gradient carries it in an extra column (C). So the chunk knows which
// microbatch each pass runs, logs the call with it, and reports as a
// problem any pass whose inputs belong to another microbatch: a wrong
// receive buffer, a slot reused while its microbatch is still alive, a
// gradient for another microbatch. It also asks the test, before writing a
// slot's output, whether a send still reads it (AffineTrace::send_unjoined).
//
// A split backward keeps what its weight part needs outside the slot (a
// queue in input-part order), so the slot may be reused as soon as the
// input part has run.
//
//   AffineTrace trace;
//   AffineChunk c(affine_dims(4, 3), ChunkPlacement::of_chunk(4, 2, 0), {.micro_batch = 2, .seq_len = 3,
//                 .activation_slots = 4, .split_backward = true}, &trace);
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "models/model.h"
#include "tests/support/clock_probe.h"

namespace xirang {

// One pass the executor ran.
struct ChunkCall {
  enum Kind { Forward, Backward, InputGrad, WeightGrad };
  Kind kind;
  int microbatch;  // the microbatch its data carried
  int chunk;       // model chunk
  int slot;
  GradPhase phase;
  std::optional<StepPart> part;  // the step clock's part the pass ran in
};

// What the chunks of one rank record.
struct AffineTrace {
  std::vector<ChunkCall> calls;
  std::vector<std::string> problems;
  std::function<void(const ChunkCall&)> on_call;         // each call as it happens (optional)
  std::function<bool(const Tensor&)> send_unjoined;      // a send still reads this buffer (optional)
  std::vector<int> hooks;                                // gradient-ready layers, in order
};

inline ModelDims affine_dims(int n_layer, int width) {
  ModelDims d;
  d.arch = "affine";
  d.n_layer = n_layer;
  d.d_model = width;
  d.n_head = 1;
  return d;
}

inline const char* chunk_call_name(ChunkCall::Kind k) {
  switch (k) {
    case ChunkCall::Forward: return "F";
    case ChunkCall::Backward: return "B";
    case ChunkCall::InputGrad: return "Bi";
    case ChunkCall::WeightGrad: return "W";
  }
  return "?";
}

class AffineChunk final : public ModelChunk {
 public:
  AffineChunk(const ModelDims& dims, const ChunkPlacement& at, const ChunkBatch& batch, AffineTrace* trace)
      : ModelChunk(dims, at, DType::F64, batch), trace_(trace), C_(dims.d_model), R_(batch.micro_batch * batch.seq_len) {
    const int64_t C = C_;
    auto add = [&](std::string name, int layer, bool decay) {
      params_.push_back(Parameter{name, Tensor(nullptr, {C}, DType::F64), Tensor(nullptr, {C}, DType::F64), decay, layer,
                                  ShardSpec::whole({C}), false, false, InitRule::normal(1.0)});
      return int(params_.size()) - 1;
    };
    if (at.has_embedding) emb_ = add("emb", -1, true);
    for (int l = at.first_layer; l < at.end_layer; ++l) {
      w_.push_back(add(str_cat("w.", l), l, true));
      b_.push_back(add(str_cat("b.", l), l, false));
    }
    if (at.has_head) head_ = add("head", dims.n_layer, true);
  }

  // w near 1 and the rest of order 1: activations neither vanish nor grow over the layers.
  void init_parameters(uint64_t seed) override {
    for (const Parameter& p : params_) {
      const bool w = p.name.rfind("w.", 0) == 0, b = p.name.rfind("b.", 0) == 0;
      double* v = p.value.data<double>();
      for (int64_t i = 0; i < p.value.numel(); ++i) {
        const double n = rng_normal(seed, name_stream(p.name), uint64_t(i));
        v[i] = w ? 1 + 0.25 * n : b ? 0.25 * n : n;
      }
    }
  }

  void layout_activations(Arena& a) override {
    const int slots = batch_.activation_slots, L = layers();
    h_.assign(size_t(slots), {});
    for (auto& hs : h_)
      for (int k = 0; k <= L; ++k) hs.push_back(a.alloc({R_, C_ + 1}, DType::F64, "affine activation"));
    input_grad_ = a.alloc({R_, C_ + 1}, DType::F64, "affine input gradient");
    live_.assign(size_t(slots), -1);
    y_.assign(size_t(slots), std::vector<double>(size_t(R_)));
    tok_.assign(size_t(slots), std::vector<double>(size_t(R_)));
    dloss_.assign(size_t(slots), 0);
  }

  void forward(const KernelContext& ctx, MicrobatchSlots slots, const Tensor& tokens, const Tensor& targets,
               double dloss) override {
    const int slot = slots.activation;
    ChunkCall call{ChunkCall::Forward, -1, g(), slot, GradPhase::Final, open_part(ctx.clock)};
    XR_CHECK(slot >= 0 && slot < int(h_.size()), "affine chunk ", g(), ": slot ", slot, " of ", h_.size());
    auto& hs = h_[size_t(slot)];
    const int W = C_ + 1;
    int label = -1;
    if (placement_.has_embedding) {
      const int32_t* tk = tokens.data<int32_t>();
      label = tk[0];
      const double* emb = value(emb_);
      double* h = hs[0].data<double>();
      for (int64_t r = 0; r < R_; ++r) {
        tok_[size_t(slot)][size_t(r)] = 1 + tk[r];
        for (int c = 0; c < C_; ++c) h[r * W + c] = emb[c] * (1 + tk[r]);
        h[r * W + C_] = label;
      }
    } else {
      label = label_of(hs[0], "its stage input");
    }
    call.microbatch = label;
    if (trace_ && trace_->send_unjoined && trace_->send_unjoined(hs[size_t(layers())]))
      problem("forward of microbatch ", label, " writes slot ", slot, " while a send of it is in flight");
    if (live_[size_t(slot)] >= 0)
      problem("forward of microbatch ", label, " into slot ", slot, ", which still holds microbatch ", live_[size_t(slot)]);
    for (int k = 0; k < layers(); ++k) {
      const double *x = hs[size_t(k)].data<double>(), *w = value(w_[size_t(k)]), *b = value(b_[size_t(k)]);
      double* y = hs[size_t(k) + 1].data<double>();
      for (int64_t r = 0; r < R_; ++r) {
        for (int c = 0; c < C_; ++c) y[r * W + c] = x[r * W + c] * w[c] + b[c];
        y[r * W + C_] = x[r * W + C_];
      }
    }
    if (placement_.has_head) {
      const int32_t* tg = targets.data<int32_t>();
      if (tg[0] != label) problem("forward of microbatch ", label, " got the targets of microbatch ", tg[0]);
      const double *h = hs[size_t(layers())].data<double>(), *head = value(head_);
      double loss = 0;
      for (int64_t r = 0; r < R_; ++r) {
        y_[size_t(slot)][size_t(r)] = 1 + tg[r];
        double s = 0;
        for (int c = 0; c < C_; ++c) s += h[r * W + c] * head[c];
        loss += (1 + tg[r]) * s;
      }
      loss_sum_ += loss / double(R_);
      dloss_[size_t(slot)] = dloss;
    }
    live_[size_t(slot)] = label;
    log(call);
  }

  double take_loss(const KernelContext&) override {
    const double l = loss_sum_;
    loss_sum_ = 0;
    return l;
  }

  // A split backward's weight part finds its input part by the weight slot
  // (the activation slot is free from the input part on).
  void backward(const KernelContext& ctx, MicrobatchSlots slots, const Tensor&, GradPhase phase,
                const Tensor& output_grad, BackwardPart part) override {
    const std::optional<StepPart> at = open_part(ctx.clock);
    if (part == BackwardPart::WeightGrad) {
      weight_part(slots.weight, phase, at);
      return;
    }
    const int slot = slots.activation;
    const int label = live_[size_t(slot)];
    if (label < 0) problem("backward of slot ", slot, ", which holds no microbatch");
    ChunkCall call{part == BackwardPart::Full ? ChunkCall::Backward : ChunkCall::InputGrad, label, g(), slot, phase, at};
    const int W = C_ + 1, L = layers();
    const auto& hs = h_[size_t(slot)];
    Saved s{label, part == BackwardPart::InputGrad ? slots.weight : slot, phase, {}, {}, {}, {}, {}, tok_[size_t(slot)]};
    std::vector<double> dh(size_t(R_ * C_));
    if (placement_.has_head) {
      const double* head = value(head_);
      s.top_scale.resize(size_t(R_));
      for (int64_t r = 0; r < R_; ++r) {
        s.top_scale[size_t(r)] = dloss_[size_t(slot)] * y_[size_t(slot)][size_t(r)];
        for (int c = 0; c < C_; ++c) dh[size_t(r * C_ + c)] = s.top_scale[size_t(r)] * head[c];
      }
      s.top = copy(hs[size_t(L)]);
    } else {
      const int got = label_of(output_grad, "its output gradient");
      if (got != label) problem("backward of microbatch ", label, " got the output gradient of microbatch ", got);
      const double* og = output_grad.data<double>();
      for (int64_t r = 0; r < R_; ++r)
        for (int c = 0; c < C_; ++c) dh[size_t(r * C_ + c)] = og[r * W + c];
    }
    s.x.resize(size_t(L));
    s.dy.resize(size_t(L));
    for (int k = L - 1; k >= 0; --k) {
      double* db = grad(b_[size_t(k)]);
      for (int c = 0; c < C_; ++c) {
        double sum = 0;
        for (int64_t r = 0; r < R_; ++r) sum += dh[size_t(r * C_ + c)];
        db[c] += sum;
      }
      s.x[size_t(k)] = copy(hs[size_t(k)]);
      s.dy[size_t(k)] = dh;
      const double* w = value(w_[size_t(k)]);
      for (int64_t r = 0; r < R_; ++r)
        for (int c = 0; c < C_; ++c) dh[size_t(r * C_ + c)] *= w[c];
    }
    s.bottom = dh;
    if (!placement_.has_embedding) {
      double* ig = input_grad_.data<double>();
      for (int64_t r = 0; r < R_; ++r) {
        for (int c = 0; c < C_; ++c) ig[r * W + c] = dh[size_t(r * C_ + c)];
        ig[r * W + C_] = label;
      }
    }
    live_[size_t(slot)] = -1;  // what the weight part needs is in `s`
    log(call);
    if (part == BackwardPart::Full)
      weight_products(s);
    else
      saved_.push_back(std::move(s));
  }
  bool splits_backward() const override { return true; }

  Tensor stage_input(int slot) override { return h_[size_t(slot)][0]; }
  Tensor stage_output(int slot) override { return h_[size_t(slot)][size_t(layers())]; }
  Tensor input_grad() override { return input_grad_; }
  double flops_per_token() const override { return 1; }
  TpCommTime take_tp_comm() override { return {}; }

  // Weight parts not yet run (a split backward's).
  size_t pending_weight_parts() const { return saved_.size(); }

 private:
  // What a weight part needs, kept from its input part: the layers' inputs
  // and output gradients, the head's input and loss scale, the embedding's factors.
  struct Saved {
    int label, slot;
    GradPhase phase;
    std::vector<std::vector<double>> x, dy;  // per layer: (R, C+1) input, (R, C) output gradient
    std::vector<double> top, top_scale;      // last chunk: (R, C+1) head input, (R) dloss * (1 + target)
    std::vector<double> bottom;              // (R, C) gradient of the chunk's input
    std::vector<double> tok;                 // first chunk: (R) 1 + token
  };

  int g() const { return placement_.first_layer / std::max(1, placement_.end_layer - placement_.first_layer); }
  int layers() const { return placement_.end_layer - placement_.first_layer; }
  const double* value(int i) const { return params_[size_t(i)].value.data<double>(); }
  double* grad(int i) const { return params_[size_t(i)].grad.data<double>(); }
  static std::vector<double> copy(const Tensor& t) {
    const double* p = t.data<double>();
    return std::vector<double>(p, p + t.numel());
  }
  template <class... Args>
  void problem(Args&&... args) {
    if (trace_) trace_->problems.push_back(str_cat("chunk ", g(), ": ", std::forward<Args>(args)...));
  }
  void log(const ChunkCall& call) {
    if (!trace_) return;
    trace_->calls.push_back(call);
    if (trace_->on_call) trace_->on_call(call);
  }
  // The microbatch an (R, C+1) activation or gradient carries (-1 when its rows disagree).
  int label_of(const Tensor& t, const char* what) {
    const double* p = t.data<double>();
    const double label = p[C_];
    for (int64_t r = 1; r < R_; ++r)
      if (p[r * (C_ + 1) + C_] != label) {
        problem(what, " mixes microbatches");
        return -1;
      }
    return int(label);
  }

  // The weight-gradient products, each layer's hook once its gradients are
  // whole: the head, the layers from the last, the embedding.
  void weight_products(const Saved& s) {
    const int W = C_ + 1, L = layers();
    const bool final = s.phase == GradPhase::Final;
    if (placement_.has_head) {
      double* dh = grad(head_);
      for (int c = 0; c < C_; ++c) {
        double sum = 0;
        for (int64_t r = 0; r < R_; ++r) sum += s.top_scale[size_t(r)] * s.top[size_t(r * W + c)];
        dh[c] += sum;
      }
      if (final) hook(dims_.n_layer);
    }
    for (int k = L - 1; k >= 0; --k) {
      double* dw = grad(w_[size_t(k)]);
      for (int c = 0; c < C_; ++c) {
        double sum = 0;
        for (int64_t r = 0; r < R_; ++r) sum += s.dy[size_t(k)][size_t(r * C_ + c)] * s.x[size_t(k)][size_t(r * W + c)];
        dw[c] += sum;
      }
      if (final) hook(placement_.first_layer + k);
    }
    if (placement_.has_embedding) {
      double* de = grad(emb_);
      for (int c = 0; c < C_; ++c) {
        double sum = 0;
        for (int64_t r = 0; r < R_; ++r) sum += s.bottom[size_t(r * C_ + c)] * s.tok[size_t(r)];
        de[c] += sum;
      }
      if (final) hook(-1);
    }
  }
  void hook(int layer) {
    if (trace_) trace_->hooks.push_back(layer);
    grad_ready(layer);
  }
  // The oldest input part of weight slot `slot` whose weight part has not run.
  void weight_part(int slot, GradPhase phase, std::optional<StepPart> at) {
    auto it = saved_.begin();
    while (it != saved_.end() && it->slot != slot) ++it;
    if (it == saved_.end()) {
      problem("weight part of slot ", slot, " without its input part");
      return;
    }
    Saved s = std::move(*it);
    saved_.erase(it);
    if (s.phase != phase) problem("weight part of microbatch ", s.label, " in another phase than its input part");
    log({ChunkCall::WeightGrad, s.label, g(), slot, phase, at});
    weight_products(s);
  }

  AffineTrace* trace_;
  int C_;
  int64_t R_;
  int emb_ = -1, head_ = -1;
  std::vector<int> w_, b_;                 // parameter index of each local layer's w and b
  std::vector<std::vector<Tensor>> h_;     // per slot: (R, C+1) chunk input and each layer's output
  Tensor input_grad_;                      // (R, C+1)
  std::vector<int> live_;                  // per slot: its microbatch until its backward's input part, else -1
  std::vector<std::vector<double>> y_;     // per slot: (R) 1 + target (last chunk)
  std::vector<std::vector<double>> tok_;   // per slot: (R) 1 + token (first chunk)
  std::vector<double> dloss_;              // per slot
  std::deque<Saved> saved_;                // input parts whose weight part is pending, in order
  double loss_sum_ = 0;
};

}  // namespace xirang
