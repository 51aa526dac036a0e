// runtime/config/named_values.h: the config's named values (an enum whose
// YAML spelling is one of a fixed set of words) and their spellings.
//
// One table per enum, ConfigNames<E>, lists its spellings in enum order;
// reading (parse_config_name), writing (config_name), the "one of ..." of
// every message and the schema's parsing and emitted YAML are all derived
// from it. A new named value is its enum, its table here, and its schema
// row in config.cc.
//
//   config_name(Precision::BF16)                        // "bf16"
//   parse_config_name<Recompute>("full")                // Recompute::Full; std::nullopt for "1"
//   parse_named<ScheduleKind>("zb_h1", "--schedule")    // or a Config error listing the spellings
//   config_names_text<BusyPollMode>()                   // "auto, on, off"
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "core/error.h"
#include "kernels/moe.h"
#include "kernels/rope.h"
#include "models/dims.h"
#include "models/layers/activation.h"

namespace xirang {

// parallel.schedule.
// zb_h1: 1F1B with each backward split into its input- and weight-gradient
// parts, the weight parts deferred into the cool-down (runtime/step/schedule.h);
// zb_h2: the same parts with 2p - 1 microbatches in flight, the extra
// warm-up forwards filling the bubble before the first backward; zb_v:
// two chunks per rank in a V (ChunkOrder::V; CPU over tagged MPI only, runtime/config/schedule_rules.h).
enum class ScheduleKind { GPipe, OneFOneB, Interleaved, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV };
enum class Precision { FP32, BF16, FP16 };  // precision.dtype
enum class Backend { CPU, CUDA };           // device.backend
// parallel.cp_split: how a cp group cuts each sequence (kernels/context_split.h):
// head_tail (rank i holds chunks i and 2c-1-i, causal work balanced) or contiguous.
enum class CpSplit { HeadTail, Contiguous };
// parallel.cp_comm: how a cp group's attention exchanges keys and values
// (models/layers/cp_comm.h): all_gather (every block at once, exposed) or
// ring (blocks passed around the group while attention works on the one in hand).
enum class CpCommKind { AllGather, Ring };
// faults.kind (runtime/config/config.h FaultConfig)
enum class FaultKind { None, Kill, Hang, FailTransfer, KillInSave, SlowRank, NanGrad, IoError };
// comm.busy_poll (comm/communicator.h BusyPoll)
enum class BusyPollMode { Auto, On, Off };
// checkpoint.on_error: stop (a failed save ends the run), continue (warn and train on)
enum class SaveErrorPolicy { Stop, Continue };
// train.recompute: models/layers/activation.h's Recompute.
// model.rope_scaling.type: kernels/rope.h's RopeScaling::Type.
// model.moe.score: kernels/moe.h's RouterScore; model.moe.aux_loss: models/dims.h's MoeAuxLoss.

// The spellings of E, in enum order: E(i) is spelled names[i].
template <class E>
struct ConfigNames;

template <>
struct ConfigNames<ScheduleKind> {
  static constexpr const char* names[] = {"gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v"};
};
template <>
struct ConfigNames<Precision> {
  static constexpr const char* names[] = {"fp32", "bf16", "fp16"};
};
template <>
struct ConfigNames<CpSplit> {
  static constexpr const char* names[] = {"head_tail", "contiguous"};
};
template <>
struct ConfigNames<CpCommKind> {
  static constexpr const char* names[] = {"all_gather", "ring"};
};
template <>
struct ConfigNames<Backend> {
  static constexpr const char* names[] = {"cpu", "cuda"};
};
template <>
struct ConfigNames<FaultKind> {
  static constexpr const char* names[] = {"none",      "kill",     "hang",    "fail_transfer", "kill_in_save",
                                          "slow_rank", "nan_grad", "io_error"};
};
template <>
struct ConfigNames<BusyPollMode> {
  static constexpr const char* names[] = {"auto", "on", "off"};
};
template <>
struct ConfigNames<SaveErrorPolicy> {
  static constexpr const char* names[] = {"stop", "continue"};
};
template <>
struct ConfigNames<Recompute> {
  static constexpr const char* names[] = {"none", "selective", "full"};
};
template <>
struct ConfigNames<RopeScaling::Type> {
  static constexpr const char* names[] = {"none", "llama3"};
};
template <>
struct ConfigNames<RouterScore> {
  static constexpr const char* names[] = {"softmax", "sigmoid"};
};
template <>
struct ConfigNames<MoeAuxLoss> {
  static constexpr const char* names[] = {"none", "seq", "global"};
};

template <class E>
concept NamedValue = std::is_enum_v<E> && requires { ConfigNames<E>::names; };

template <NamedValue E>
constexpr std::span<const char* const> config_names() {
  return ConfigNames<E>::names;
}

// The spelling of a value ("bf16", "zb_h1"), for messages and the emitted YAML.
template <NamedValue E>
const char* config_name(E v) {
  const auto names = config_names<E>();
  XR_CHECK(size_t(v) < names.size(), "a named value outside its table: ", int(v));
  return names[size_t(v)];
}

// The value spelled `text`, exactly (no case folding, no numbers); nullopt otherwise.
template <NamedValue E>
std::optional<E> parse_config_name(std::string_view text) {
  const auto names = config_names<E>();
  for (size_t i = 0; i < names.size(); ++i)
    if (text == names[i]) return E(i);
  return std::nullopt;
}

// "a, b, c": the spellings as a message lists them.
inline std::string join_config_names(std::span<const char* const> names) {
  std::string out;
  for (const char* n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}
template <NamedValue E>
std::string config_names_text() {
  return join_config_names(config_names<E>());
}

// The value spelled `text`, or a Config error "<where>='<text>' is not one of a, b, c".
template <NamedValue E>
E parse_named(std::string_view text, std::string_view where) {
  if (const std::optional<E> v = parse_config_name<E>(text)) return *v;
  fail(ErrorKind::Config, where, "='", text, "' is not one of ", config_names_text<E>());
}

}  // namespace xirang
