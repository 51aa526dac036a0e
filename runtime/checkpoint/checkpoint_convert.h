// runtime/checkpoint/checkpoint_convert.h: offline checkpoint conversion (`xirang ckpt convert`).
//
// Owns the work behind the command, without its argument parsing:
//   - resharding a checkpoint into another parallel layout: every rank file
//     of the new layout holds exactly what that rank's trainer would save
//     (parameters from dp rank 0 of each tp/pp position, optimizer state
//     whole or split over the dp ranks under ZeRO-1), read through
//     CheckpointReader so only the slices each rank needs are read;
//   - changing the stored parameter dtype, dropping the optimizer state;
//   - exporting the parameters as a Hugging Face safetensors file with its
//     config.json;
//   - importing such a file (and the config.json beside it), or an llm.c
//     model file, checked against a config, as a parameters-only
//     checkpoint at step 0.
// Names, stored shapes and layouts in those files are the architecture's
// (ModelArch::files, models/file_adapter.h); an architecture without an
// adapter can be resharded but not exported or imported.
// Destinations appear complete or not at all (a staged directory or a
// temporary file, renamed into place); an existing destination is replaced
// only on request, and never when it is, holds or lies inside the source.
// Format details: docs/checkpoint_format.md, "Conversion".
//
//   ConvertOptions o;
//   o.layout = CheckpointLayout{.dp = 2, .tp = 2, .pp = 2, .zero = 1};
//   reshard_checkpoint("runs/ck", "runs/ck_8ranks", o);              // newest step of runs/ck
//   export_hf_safetensors("runs/ck/step_00000100", "hf/model.safetensors", {});  // + hf/config.json
//   import_model_file("llmc/model.bin", load_config("run.yaml"), "runs/imported", {});
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"

namespace xirang {

enum class ModelFormat {
  Checkpoint,   // a Xirang checkpoint: a step directory or a root
  Safetensors,  // Hugging Face safetensors
  LlmC,         // llm.c's model file (256 int32 of header, then raw values)
};
const char* model_format_name(ModelFormat f);

// What `path` holds, judged by its content: a directory with meta.json or
// complete steps is a checkpoint; a file whose first 8 bytes are a
// little-endian length followed by '{' is safetensors; a file starting with
// the int32 20240326 is an llm.c model. A file named *.safetensors or *.bin
// is taken to be that format, so that reading it names what is wrong with
// it. Anything else is a Data error.
ModelFormat detect_model_format(const std::string& path);

// A checkpoint step directory or root, resolved to the step directory
// (the newest complete step of a root); a Checkpoint error when there is none.
std::string checkpoint_step_dir(const std::string& path);

// Throws a Config error naming the rule when `dims` is no valid model or
// `layout` cannot hold it (models/model.h, layout_problem), or zero is not
// 0 or 1.
void check_checkpoint_layout(const ModelDims& dims, const CheckpointLayout& layout);

// The parameters world rank `rank` of `layout` holds, in its trainer's order
// (local chunks in order): names, ShardSpecs and local shapes from the
// architecture's parameter list (ModelArch::parameters) with the trainer's
// own chunk split; value and grad have no storage. A later chunk's copy of
// a tied parameter is included, marked tied_copy.
std::vector<Parameter> rank_parameters(const ModelDims& dims, const CheckpointLayout& layout, int rank);

struct ConvertOptions {
  std::optional<CheckpointLayout> layout;  // checkpoint destinations; default: the source's, one rank for imports
  std::optional<DType> dtype;              // stored parameters; default: as stored (reshard), f32 (export, import)
  bool params_only = false;                // leave the optimizer state out
  bool overwrite = false;                  // replace an existing destination
};

struct ConvertResult {
  std::string path;             // the new step directory, or the safetensors file
  int64_t step = 0;
  CheckpointLayout layout;      // checkpoint destinations
  int64_t tensors = 0;          // entries (checkpoint) or tensors (safetensors) written
  bool optimizer_state = false; // whether the new checkpoint holds optimizer state
};

// Writes checkpoint `src` (a step directory or a root: its newest step) as a
// new checkpoint root `dst` holding one committed step (same step, config
// and scalars) in options.layout.
ConvertResult reshard_checkpoint(const std::string& src, const std::string& dst, const ConvertOptions& options);

// Writes the parameters of checkpoint `src` as Hugging Face safetensors
// `dst` (dtype f32, bf16 or f16), and config.json in the same directory.
// A Config error when the checkpoint's model.arch has no file adapter.
ConvertResult export_hf_safetensors(const std::string& src, const std::string& dst, const ConvertOptions& options);

// Reads a safetensors or llm.c model file (detect_model_format), checks a
// safetensors file's config.json (when beside it) and every tensor against
// `config`'s model and writes it as a parameters-only
// checkpoint root `dst` at step 0, with config.yaml as its configuration.
// A Config error when config's model.arch has no file adapter.
ConvertResult import_model_file(const std::string& src, const Config& config, const std::string& dst,
                                const ConvertOptions& options);

}  // namespace xirang
