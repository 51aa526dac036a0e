// xirang ckpt inspect PATH
// xirang ckpt convert SRC DST [--layout dp=D,tp=T,pp=P[,zero=Z][,virtual_stages=V]]
//                             [--dtype f32|bf16|f16] [--params-only] [--to xirang|hf]
//                             [--config CFG.yaml] [--force]
//
// inspect: PATH is a checkpoint step directory or a checkpoint root (its
// newest complete step is inspected). Prints the step, the layout it was
// saved from, every tensor entry (group/name, global shape, stored dtype, the
// slice it holds, the rank file), and verifies every checksum; exits 1 when
// an entry is damaged.
//
// convert: SRC's format comes from its content (runtime/checkpoint/checkpoint_convert.h).
// A checkpoint becomes a new checkpoint root DST in another layout, dtype or
// without optimizer state, or with --to hf (implied by DST ending in
// .safetensors) a Hugging Face safetensors file plus config.json (GPT-2 or
// LLaMA: the architecture's file adapter). A safetensors or llm.c model
// file becomes a parameters-only checkpoint at step 0 of the model --config
// describes; a config.json beside a safetensors file must agree with it. DST is never replaced without
// --force, and never when it is or holds SRC.
#include <cstdio>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "runtime/checkpoint/checkpoint_convert.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "tools/commands.h"

namespace xirang::tools {

namespace {

const char* kConvertUsage =
    "usage: xirang ckpt convert SRC DST [--layout dp=D,tp=T,pp=P[,zero=Z][,virtual_stages=V]]\n"
    "                               [--dtype f32|bf16|f16] [--params-only] [--to xirang|hf] [--config CFG.yaml] [--force]";

std::string slice_str(const CheckpointEntry& e) {
  std::string s = e.shard.replicated() ? "whole"
                                       : str_cat("dim ", e.shard.dim, " part ", e.shard.index, "/", e.shard.parts,
                                                 e.shard.blocks > 1 ? str_cat(" (", e.shard.blocks, " blocks)") : "");
  if (e.flat_begin != 0 || e.flat_end != e.local.numel()) s += str_cat(" [", e.flat_begin, ", ", e.flat_end, ")");
  return s;
}

std::string layout_str(const CheckpointLayout& l) {
  return str_cat("dp ", l.dp, " x tp ", l.tp, " x pp ", l.pp, l.zero ? " (ZeRO-1)" : "",
                 l.virtual_stages > 1 ? str_cat(", ", l.virtual_stages, " virtual stages") : "");
}

int inspect(const std::string& path) {
  const std::string step_dir = checkpoint_step_dir(path);
  CheckpointReader r = CheckpointReader::open(step_dir);
  const CheckpointMeta& m = r.meta();
  std::printf("checkpoint %s\n  step %lld, saved from dp %d x tp %d x pp %d (zero %d, virtual stages %d%s), %zu rank files\n",
              step_dir.c_str(), (long long)m.step, m.layout.dp, m.layout.tp, m.layout.pp, m.layout.zero,
              m.layout.virtual_stages, m.layout.sequence_parallel ? ", sequence parallel" : "", m.rank_files.size());
  for (const CheckpointEntry& e : r.entries())
    std::printf("  %-8s %-28s %-14s %-5s %-26s rank %d\n", e.group.c_str(), e.name.c_str(), e.shard.global.str().c_str(),
                dtype_name(e.dtype), slice_str(e).c_str(), e.rank);
  const auto damaged = r.verify_all();
  for (const std::string& d : damaged) std::printf("DAMAGED: %s\n", d.c_str());
  std::printf("%zu entries, %zu damaged (checksums verified)\n", r.entries().size(), damaged.size());
  return damaged.empty() ? 0 : 1;
}

// "dp=2,tp=2,pp=2,zero=1,virtual_stages=2"; keys left out keep their defaults (1, zero 0).
CheckpointLayout parse_layout(const std::string& text) {
  CheckpointLayout l;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    int* field = key == "dp" ? &l.dp : key == "tp" ? &l.tp : key == "pp" ? &l.pp : key == "zero" ? &l.zero
               : key == "virtual_stages" ? &l.virtual_stages : nullptr;
    if (!field)
      fail(ErrorKind::Usage, "--layout '", text, "': unknown key '", key, "' (expected dp, tp, pp, zero, virtual_stages)");
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (value.empty() || used != value.size() || v < 0)
      fail(ErrorKind::Usage, "--layout '", text, "': ", key, " needs a non-negative integer, got '", value, "'");
    *field = v;
    at = comma + 1;
  }
  return l;
}

struct ConvertArgs {
  std::string src, dst, to, config;
  ConvertOptions options;
};

ConvertArgs parse_convert(int argc, char** argv) {
  ConvertArgs a;
  std::vector<std::string> paths;
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "ckpt convert: ", s, " needs a value (see xirang ckpt convert --help)");
      return argv[++i];
    };
    if (s == "--layout") a.options.layout = parse_layout(value());
    else if (s == "--dtype") {
      const std::string d = value();
      const DType t = parse_dtype(d, "--dtype");
      if (t != DType::F32 && t != DType::BF16 && t != DType::F16)
        fail(ErrorKind::Usage, "ckpt convert: --dtype ", d, " (expected f32, bf16 or f16)");
      a.options.dtype = t;
    } else if (s == "--params-only") a.options.params_only = true;
    else if (s == "--force") a.options.overwrite = true;
    else if (s == "--to") a.to = value();
    else if (s == "--config") a.config = value();
    else if (!s.empty() && s[0] == '-')
      fail(ErrorKind::Usage, "ckpt convert: unknown option '", s, "' (see xirang ckpt convert --help)");
    else paths.push_back(s);
  }
  if (paths.size() != 2)
    fail(ErrorKind::Usage, "ckpt convert: expected SRC and DST, got ", paths.size(),
         " paths (see xirang ckpt convert --help)");
  a.src = paths[0];
  a.dst = paths[1];
  if (a.to.empty()) a.to = std::filesystem::path(a.dst).extension() == ".safetensors" ? "hf" : "xirang";
  if (a.to != "hf" && a.to != "xirang") fail(ErrorKind::Usage, "ckpt convert: --to ", a.to, " (expected xirang or hf)");
  return a;
}

int convert(const ConvertArgs& a) {
  const ModelFormat from = detect_model_format(a.src);
  if (a.to == "hf") {
    if (from != ModelFormat::Checkpoint)
      fail(ErrorKind::Usage, "ckpt convert --to hf exports a xirang checkpoint, but '", a.src, "' is a ",
           model_format_name(from));
    if (!a.config.empty()) fail(ErrorKind::Usage, "ckpt convert: --config is for imports (a checkpoint carries its own)");
    const ConvertResult r = export_hf_safetensors(a.src, a.dst, a.options);
    std::printf("wrote %s (%lld tensors, %s) and config.json from the checkpoint at step %lld\n", r.path.c_str(),
                (long long)r.tensors, dtype_name(a.options.dtype.value_or(DType::F32)), (long long)r.step);
    return 0;
  }
  ConvertResult r;
  if (from == ModelFormat::Checkpoint) {
    if (!a.config.empty()) fail(ErrorKind::Usage, "ckpt convert: --config is for imports (a checkpoint carries its own)");
    r = reshard_checkpoint(a.src, a.dst, a.options);
  } else {
    if (a.config.empty())
      fail(ErrorKind::Usage, "ckpt convert: importing a ", model_format_name(from),
           " needs --config CFG.yaml (the model it holds)");
    r = import_model_file(a.src, load_config(a.config), a.dst, a.options);
  }
  std::printf("wrote %s: step %lld, %s, %lld entries, %s\n", r.path.c_str(), (long long)r.step,
              layout_str(r.layout).c_str(), (long long)r.tensors,
              r.optimizer_state ? "with optimizer state" : "parameters only");
  return 0;
}

}  // namespace

int ckpt_command(int argc, char** argv) {
  if (argc < 2) fail(ErrorKind::Usage, "ckpt: expected a verb (usage: xirang ckpt inspect PATH | convert SRC DST ...)");
  const std::string verb = argv[1];
  if (verb == "inspect") {
    if (argc != 3) fail(ErrorKind::Usage, "ckpt inspect: expected one PATH (a checkpoint step directory or root)");
    return inspect(argv[2]);
  }
  if (verb == "convert") {
    for (int i = 2; i < argc; ++i)
      if (std::string(argv[i]) == "-h" || std::string(argv[i]) == "--help") {
        std::printf("%s\n", kConvertUsage);
        return 0;
      }
    return convert(parse_convert(argc, argv));
  }
  fail(ErrorKind::Usage, "ckpt: unknown verb '", verb, "' (expected inspect or convert)");
}

}  // namespace xirang::tools
