// models/model.h: the interface the runtime sees, and the registry of
// architectures.
//
// The runtime trains any model through ModelChunk: one object per pipeline
// chunk (a contiguous range of layers, plus the embedding on the first chunk
// and the final norm, head and loss on the last; one chunk holds everything
// on a single rank). A chunk lays out its parameters and activations in
// arenas the runtime sizes and owns, runs the forward and backward of one
// microbatch in an activation slot, hands its output to the next chunk and
// its input gradient to the previous one, and reports when a layer's
// gradients are final so that their data-parallel reduction can start.
//
// `model.arch` picks a ModelArch from the registry. Besides building
// chunks, an architecture lists a layout's parameter specs (names, global
// shapes, shards, init rules) without any communicator: checkpoint
// conversion, memory plans and tests use that list. Every architecture so
// far is a decoder spec (models/decoder/decoder_chunk.h's decoder_arch
// fills every field from it; docs/architecture.md, "Adding an
// architecture"): make_chunk, parameters, layout_problem, key_rules,
// make_decoder, and a name adapter for foreign checkpoint files.
//
//   const ModelArch& arch = model_arch(dims.arch);
//   check_layout(dims, layout);                                      // throws a Config error
//   std::unique_ptr<ModelChunk> c = arch.make_chunk(dims, ChunkPlacement::of_chunk(dims.n_layer, p * v, g),
//                                                   DType::F32, {.micro_batch = 4, .seq_len = 256, .activation_slots = 3,
//                                                                .recompute = Recompute::Selective},
//                                                   {.group = &grid.tp(), .sequence_parallel = true});
//   c->layout_parameters(param_arena, grad_arena);
//   c->layout_activations(act_arena);
//   c->init_parameters(seed);
//   c->forward(ctx, slot, tokens, targets, dloss);     // dloss > 0: training
//   c->backward(ctx, slot, tokens, GradPhase::Final);
//   double loss = c->take_loss(ctx);                   // the sum of the forwards' mean losses
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/arena.h"
#include "kernels/context.h"
#include "kernels/context_split.h"
#include "kernels/rope.h"
#include "models/dims.h"
#include "models/file_adapter.h"
#include "models/layers/activation.h"
#include "models/parameter.h"
#include "models/placement.h"

namespace xirang {

class Decoder;  // models/decode.h

// A pass's tensor-parallel collectives on a device, whose device time is
// known once they have completed (Work::duration_ms). Their host time is
// the step clock's TpComm part (core/step_clock.h).
struct TpCommTime {
  std::vector<WorkPtr> device_work;
};

// Recompute (train.recompute) lives with the layers' activation lists: models/layers/activation.h.

// Context parallelism (parallel.cp): the sequence is cut over `size` ranks
// (kernels/context_split.h); a chunk holds rank `rank`'s T / size rows of
// every sequence, and its attention gathers keys and values over `group`.
// Without a group and size > 1, the chunk is laid out as that rank (memory
// plans) and refuses to run.
// parallel.cp_comm: keys and values all-gathered, or passed around a ring
// overlapped with attention (models/layers/cp_comm.h).
enum class CpExchange { AllGather, Ring };
struct ContextParallel {
  Communicator* group = nullptr;  // the cp group; null means a group of one
  int size = 1, rank = 0;
  bool head_tail = true;          // parallel.cp_split: head_tail (balanced) or contiguous
  CpExchange exchange = CpExchange::AllGather;
  ContextSplit split(int64_t seq_len) const { return ContextSplit::of(seq_len, size, head_tail); }
};

struct ChunkBatch {
  int micro_batch = 1;       // sequences per microbatch (B)
  int seq_len = 64;          // tokens per sequence (T), the whole sequence: a cp rank holds T / cp.size of them
  int activation_slots = 1;  // microbatches whose activations are alive at once
  Recompute recompute = Recompute::None;
  // Lay out what a backward split into its input- and weight-gradient
  // parts keeps between them (BackwardPart; chunks that splits_backward()).
  bool split_backward = false;
  // With split_backward, the pools that outlive an activation slot
  // (MicrobatchSlots); 0: activation_slots.
  int input_slots = 0;   // microbatches from their forward to their weight part
  int weight_slots = 0;  // microbatches from their input part to their weight part
  ContextParallel cp;    // this rank's share of each sequence (last, so positional initializers keep their meaning)
  int inputs() const { return input_slots > 0 ? input_slots : activation_slots; }
  int weights() const { return weight_slots > 0 ? weight_slots : activation_slots; }
};

// Where one microbatch's tensors live in its chunk's pools. The activation
// slot holds what the input-gradient part (or the fused backward) reads;
// it is free again once that part has run. A chunk that splits its
// backward keeps the weight products' layer inputs in an input slot, from
// the forward to the weight part, and what the input part copies for the
// weight part (output gradients, recomputed or gathered inputs) in a
// weight slot, from the input part to the weight part. A caller that
// frees the activation slot at the input part must give each microbatch
// its own input and weight slots; one index names all three where none
// is reused before the microbatch's weight part (one microbatch at a time).
struct MicrobatchSlots {
  int activation = 0;
  int input = 0;
  int weight = 0;
  MicrobatchSlots(int slot) : activation(slot), input(slot), weight(slot) {}  // NOLINT: one index for all three
  MicrobatchSlots(int activation_slot, int input_slot, int weight_slot)
      : activation(activation_slot), input(input_slot), weight(weight_slot) {}
};

struct TensorParallel {
  Communicator* group = nullptr;   // the tensor-parallel group; null means a group of one
  bool sequence_parallel = false;  // split the token rows between the parallel regions
  // Without a group, a chunk laid out as rank `rank` of `size` (size > 1):
  // its parameters and activations have that rank's shapes (memory plans,
  // the converter, the performance model), and it refuses to run.
  int size = 0, rank = 0;
};

// The parallel layout, as far as the model's shapes are concerned.
struct ParallelLayout {
  int dp = 1, tp = 1, pp = 1, virtual_stages = 1;
};

// Which part of the backward pass to run. Full is the only part every
// architecture provides; the zero-bubble schedules (ZB-H1, ZB-V) need the
// input gradient (what the previous stage waits for) and the weight
// gradients as separate instructions, and run on architectures whose
// splits_backward() is true.
enum class BackwardPart { Full, InputGrad, WeightGrad };

class ModelChunk {
 public:
  virtual ~ModelChunk() = default;
  ModelChunk(const ModelChunk&) = delete;
  ModelChunk& operator=(const ModelChunk&) = delete;

  // Carves parameters and gradients, in parameters() order, the same number
  // of elements from each arena per parameter (padded to whole 256-byte
  // blocks of the narrower type under a 16-bit dtype), so that the flat
  // buffers align.
  virtual void layout_parameters(Arena& params, Arena& grads);
  // Carves activations for every slot plus backward scratch.
  virtual void layout_activations(Arena& acts) = 0;
  // Each parameter from its init rule: f(seed, name, global element index).
  virtual void init_parameters(uint64_t seed);

  // Forward of one microbatch (tokens, targets: (B, T) int32) into
  // activation slot `slot` (and, splitting the backward, its input slot). On the chunk with the head, the mean loss over
  // its tokens joins the loss sum on the chunk's device (no wait). With
  // dloss > 0 the loss gradient (dloss per token) is prepared for backward.
  virtual void forward(const KernelContext& ctx, MicrobatchSlots slot, const Tensor& tokens, const Tensor& targets,
                       double dloss) = 0;
  // The sum of the mean losses of the forwards since the last call (0 on a
  // chunk without the head), read back to the host; the sum restarts. On a
  // device this waits for the forwards queued so far: once per step.
  virtual double take_loss(const KernelContext& ctx) = 0;
  // Backward of the microbatch in `slot`; parameter gradients accumulate. A
  // chunk without the head takes the gradient of its output (stage_output's
  // shape) from the next chunk; afterwards input_grad() holds the gradient
  // of its input. `part` other than Full needs splits_backward(): InputGrad
  // computes input_grad() (with the bias, norm, head and embedding
  // gradients) and leaves the weight-gradient products, their operands in
  // the input and weight slots; after it the activation slot may take
  // another microbatch. WeightGrad of the same input and weight slots
  // (its activation slot is not read), before either is reused, runs the
  // products and the gradient-ready calls (the hook fires from WeightGrad;
  // `phase` is InputGrad's). InputGrad then WeightGrad gives bitwise
  // Full's gradients.
  virtual void backward(const KernelContext& ctx, MicrobatchSlots slot, const Tensor& tokens,
                        GradPhase phase = GradPhase::Final, const Tensor& output_grad = Tensor(),
                        BackwardPart part = BackwardPart::Full) = 0;
  virtual bool splits_backward() const { return false; }

  // Pipeline boundaries: the activation a chunk without the embedding reads
  // (fill it before forward), the activation it hands to the next chunk
  // (valid until the slot's backward), and the gradient of its input after
  // backward (valid until the next backward).
  virtual Tensor stage_input(int slot) = 0;
  virtual Tensor stage_output(int slot) = 0;
  virtual Tensor input_grad() = 0;

  // Training FLOPs per token of the whole model (forward + backward), for MFU.
  virtual double flops_per_token() const = 0;
  // Tensor-parallel communication since the last call (TpCommTime).
  virtual TpCommTime take_tp_comm() = 0;
  // The auxiliary (balance) losses of a mixture of experts, summed over the
  // training forwards since the last call like take_loss's mean losses; 0
  // for a dense model. Reported apart: never part of the language-model loss.
  virtual double take_aux_loss() { return 0.0; }
  // After each optimizer step: state that follows the step's statistics
  // (a mixture of experts' selection bias from its loads). No-op by default.
  virtual void end_step(const KernelContext& /*ctx*/) {}

  // Called during a Final backward each time a layer's parameter gradients
  // are complete (Parameter::layer: n_layer for the final norm, l for block
  // l, -1 for the embeddings). The data-parallel reduction starts from it.
  void set_grad_ready_hook(std::function<void(int layer)> hook) { grad_ready_ = std::move(hook); }

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  // The parameters of this chunk that another pipeline chunk also holds
  // (the tied token table of the first and last chunks): their gradients
  // are summed over the pipeline's embedding group (ProcessGrid::embedding)
  // before the optimizer. The copy that is not the original has tied_copy set.
  std::vector<Parameter*> tied_parameters();
  int64_t num_parameters() const;         // this rank's
  int64_t num_global_parameters() const;  // the whole chunk's, over all tensor-parallel ranks

  const ModelDims& dims() const { return dims_; }
  const ChunkPlacement& placement() const { return placement_; }
  const ChunkBatch& batch() const { return batch_; }
  // Parameters and activations (F32, F64, BF16 or F16).
  DType dtype() const { return dtype_; }
  // Parameter gradients and the statistics kept for backward: F32 under a
  // 16-bit dtype (kernels/context.h), else dtype().
  DType grad_dtype() const { return wide_dtype_; }

 protected:
  ModelChunk(const ModelDims& dims, const ChunkPlacement& placement, DType dtype, const ChunkBatch& batch);
  void grad_ready(int layer) const {
    if (grad_ready_) grad_ready_(layer);
  }

  ModelDims dims_;
  ChunkPlacement placement_;
  DType dtype_;
  DType wide_dtype_;
  ChunkBatch batch_;
  std::vector<Parameter> params_;  // never reallocated after construction (layers keep pointers into it)

 private:
  std::function<void(int)> grad_ready_;
};

// A rule an architecture sets on one of its config keys (model.*): it
// states the rule, runtime/config checks it and words the one-line error
// (strings and number formats stop there).
struct KeyRule {
  enum class Kind {
    AtLeast,      // integer value >= bound
    Positive,     // value > 0
    NonNegative,  // value >= 0
    Above,        // value > bound
    BelowOther,   // value < other_value, the value of key `other`
    Refused,      // always broken: `why` is the whole message
  };
  Kind kind;
  std::string key;
  double value = 0;
  double bound = 0;
  std::string why;  // AtLeast, NonNegative: appended to the message; Refused: the message
  std::string other;
  double other_value = 0;

  static KeyRule at_least(std::string key, int64_t v, int64_t min, std::string why = "") {
    return {Kind::AtLeast, std::move(key), double(v), double(min), std::move(why), "", 0};
  }
  static KeyRule positive(std::string key, double v) { return {Kind::Positive, std::move(key), v, 0, "", "", 0}; }
  static KeyRule non_negative(std::string key, double v, std::string why = "") {
    return {Kind::NonNegative, std::move(key), v, 0, std::move(why), "", 0};
  }
  static KeyRule above(std::string key, double v, double bound) {
    return {Kind::Above, std::move(key), v, bound, "", "", 0};
  }
  static KeyRule below_other(std::string key, double v, std::string other, double other_v) {
    return {Kind::BelowOther, std::move(key), v, 0, "", std::move(other), other_v};
  }
  static KeyRule refused(std::string key, std::string message) {
    return {Kind::Refused, std::move(key), 0, 0, std::move(message), "", 0};
  }
};

// One architecture in the registry.
struct ModelArch {
  std::string name;  // model.arch
  // The architecture's own layout rules, beyond the pipeline's: "" when
  // `layout` can hold the model, else the rule it breaks, in config keys.
  std::function<std::string(const ModelDims&, const ParallelLayout&)> layout_problem;
  // The rules its own config keys must meet, checked in order by config
  // validation (runtime/config/validate.cc) after the keys every model has.
  std::function<std::vector<KeyRule>(const ModelDims&)> key_rules;
  // A chunk of this rank: tp.group is its tensor-parallel group.
  std::function<std::unique_ptr<ModelChunk>(const ModelDims&, const ChunkPlacement&, DType, const ChunkBatch&,
                                            const TensorParallel&)>
      make_chunk;
  // The parameters the chunk of tensor-parallel rank tp_rank of tp holds,
  // in make_chunk's order, without storage (value and grad are null views
  // of the local shapes, F32).
  std::function<std::vector<Parameter>(const ModelDims&, const ChunkPlacement&, int tp, int tp_rank)> parameters;
  // Its names, layouts and config for Hugging Face and llm.c model files
  // (models/file_adapter.h); null when it has none (no export or import).
  const ModelFileAdapter* files = nullptr;
  // Its generation loop with a key/value cache over a whole one-rank chunk
  // of this architecture (models/decode.h's make_decoder checks the chunk);
  // null when it has none.
  std::function<std::unique_ptr<Decoder>(ModelChunk&, Device, int logits_rows)> make_decoder;
  // Published models of this architecture (model.preset), each a full ModelDims.
  std::vector<ModelPreset> presets;
};

// The architecture named `name`; a Config error listing the known ones otherwise.
const ModelArch& model_arch(const std::string& name);
bool model_arch_known(const std::string& name);
// Names of every registered architecture, comma-separated ("gpt2, llama").
std::string model_arch_names();
// The preset named `name` of any architecture; a Config error listing them otherwise.
const ModelPreset& find_model_preset(const std::string& name);
// Every preset's name, comma-separated, in registry order.
std::string model_preset_names();

// Every rule a layout must meet to hold the model, stated once: the
// model's own shape, the pipeline's (n_layer % (pp x virtual_stages),
// virtual stages need pp > 1) and the architecture's. Returns "" or the
// rule broken, naming config keys (model.*, parallel.*); config validation,
// checkpoint conversion and the model constructors use it.
std::string layout_problem(const ModelDims& dims, const ParallelLayout& layout);
// The same, as a Config error.
void check_layout(const ModelDims& dims, const ParallelLayout& layout);

}  // namespace xirang
