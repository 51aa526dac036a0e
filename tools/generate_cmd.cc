// xirang generate CONFIG --checkpoint PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
//                 [--seed S] [--ignore-eos] [--set section.key=value ...]
//
// Loads the checkpoint PATH (a step directory, or a root: its newest step)
// into the model CONFIG describes, whatever layout saved it, on one rank
// (device.backend: cpu or cuda; precision.dtype), encodes TEXT with the
// tokenizer the dataset data.train was prepared with (its index.json), and
// samples up to N new tokens (default 64) with a key/value cache
// (models/decode.h): temperature T (default 1; 0 is greedy, deterministic),
// among the K most likely tokens (default 0: all), with draws that depend
// only on the seed S (default 0). stdout gets the prompt and then each new
// token's text as soon as it is sampled (GPT-2's byte-level tokens as their
// bytes: a character split over two tokens is whole once both are out),
// then a newline; stderr a summary. Generation stops at the tokenizer's
// end-of-text token (GPT-2's <|endoftext|>, which `data prepare` puts
// between documents; not printed) unless --ignore-eos is given. The
// sequence (prompt and new tokens) never exceeds model.seq_len: a prompt
// needs at least one free position, and generation stops, saying so on
// stderr, when the context is full.
//
// It runs on one rank: under a launcher with more than one rank it refuses
// (one line from rank 0). The config's parallel layout is ignored (any
// layout's checkpoint loads into the one-rank model), as are checkpoint.dir
// and the training settings. In fp32 on the CPU the tokens do not depend on
// the thread count (each kernel partitions its work so that every result
// element is summed by one thread in a fixed order).
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_runtime.h"
#include "core/device_memory.h"
#include "core/error.h"
#include "models/decode.h"
#include "runtime/checkpoint/checkpoint_convert.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/config/config.h"
#include "runtime/config/model_layout.h"
#include "runtime/data/dataset.h"
#include "runtime/data/tokenizer.h"
#include "tools/commands.h"
#ifdef XIRANG_HAVE_CUDA
#include "kernels/cuda/context.h"
#endif

namespace xirang::tools {

namespace {

const char* kGenerateUsage =
    "usage: xirang generate CONFIG --checkpoint PATH --prompt TEXT [--max-new-tokens N] [--temperature T]\n"
    "                       [--top-k K] [--seed S] [--ignore-eos] [--set section.key=value ...]\n";

struct GenerateArgs {
  std::string config_path, checkpoint;
  bool has_prompt = false;
  std::string prompt;
  int64_t max_new_tokens = 64;
  bool ignore_eos = false;
  SamplingOptions sampling;
  std::vector<std::string> overrides;
};

int64_t parse_int(const std::string& flag, const std::string& v, int64_t min, const char* expected) {
  int64_t n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size() || n < min)
    fail(ErrorKind::Usage, "generate: ", flag, " '", v, "' is not ", expected);
  return n;
}

GenerateArgs parse_args(int argc, char** argv) {
  GenerateArgs a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i], inline_value;
    bool has_inline = false;
    if (s.rfind("--", 0) == 0 && s.find('=') != std::string::npos) {
      inline_value = s.substr(s.find('=') + 1);
      s = s.substr(0, s.find('='));
      has_inline = true;
    }
    auto value = [&]() -> std::string {
      if (has_inline) return inline_value;
      if (i + 1 >= argc) fail(ErrorKind::Usage, "generate: ", s, " needs a value");
      return argv[++i];
    };
    if (s == "--set") a.overrides.push_back(value());
    else if (s == "--checkpoint") a.checkpoint = value();
    else if (s == "--prompt") a.prompt = value(), a.has_prompt = true;
    else if (s == "--max-new-tokens") a.max_new_tokens = parse_int(s, value(), 1, "a positive integer");
    else if (s == "--ignore-eos") a.ignore_eos = true;
    else if (s == "--top-k") a.sampling.top_k = int(parse_int(s, value(), 0, "an integer >= 0 (0: every token)"));
    else if (s == "--seed") a.sampling.seed = uint64_t(parse_int(s, value(), 0, "an integer >= 0"));
    else if (s == "--temperature") {
      const std::string v = value();
      char* end = nullptr;
      const double t = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !std::isfinite(t) || t < 0)
        fail(ErrorKind::Usage, "generate: --temperature '", v, "' is not a number >= 0 (0: greedy)");
      a.sampling.temperature = t;
    } else if (!s.empty() && s[0] == '-')
      fail(ErrorKind::Usage, "generate: unknown option '", s,
           "' (expected --checkpoint, --prompt, --max-new-tokens, --temperature, --top-k, --seed, --ignore-eos or --set)");
    else if (a.config_path.empty()) a.config_path = s;
    else fail(ErrorKind::Usage, "generate: more than one config file given ('", a.config_path, "' and '", s, "')");
  }
  if (a.config_path.empty() || a.checkpoint.empty() || !a.has_prompt)
    fail(ErrorKind::Usage, "generate: expected a config, --checkpoint and --prompt (usage: xirang generate CONFIG "
                           "--checkpoint PATH --prompt TEXT [...])");
  return a;
}

DType dtype_of(Precision p) {
  switch (p) {
    case Precision::BF16: return DType::BF16;
    case Precision::FP16: return DType::F16;
    default: return DType::F32;
  }
}

// The tokenizer data.train was prepared with, checked against the model's vocabulary.
std::unique_ptr<Tokenizer> dataset_tokenizer(const Config& cfg) {
  if (cfg.data.train.empty())
    fail(ErrorKind::Config, "generate takes the tokenizer of the training data, but data.train is empty "
                            "(--set data.train=DIR, a directory written by `xirang data prepare`)");
  const TokenDataset ds = TokenDataset::open(cfg.data.train);
  const DatasetIndex& ix = ds.index();
  if (ix.vocab_size > cfg.model.vocab_size)
    fail(ErrorKind::Config, "data.train '", cfg.data.train, "' was prepared with tokenizer ", ix.tokenizer,
         " of ", ix.vocab_size, " tokens, more than model.vocab_size=", cfg.model.vocab_size);
  return make_tokenizer(ix.tokenizer);
}

// The checkpoint's parameters into the chunk's (any layout; through host
// memory for a device). A checkpoint of another model is refused by name.
void load_parameters(const CheckpointReader& r, ModelChunk& chunk, const std::string& arch) {
  try {
    const std::string saved = parse_config(r.meta().config_yaml).model.arch;
    if (saved != arch)
      fail(ErrorKind::Checkpoint, "checkpoint '", r.dir(), "' holds a model.arch=", saved,
           " model, but the config describes model.arch=", arch);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Checkpoint) throw;  // else an older config text: the tensors decide
  }
  for (const Parameter& p : chunk.parameters()) {
    if (!r.has("params", p.name))
      fail(ErrorKind::Checkpoint, "checkpoint '", r.dir(), "' has no tensor '", p.name,
           "': it was saved from a different model than the config describes");
    const Shape g = r.global_shape("params", p.name);
    if (g != p.shard.global)
      fail(ErrorKind::Checkpoint, "checkpoint '", r.dir(), "': tensor '", p.name, "' has shape ", g.str(),
           " but the config's model has ", p.shard.global.str(), " (a different model.* shape)");
  }
  const bool wide = chunk.dtype() == DType::F32;
  for (Parameter& p : chunk.parameters()) {
    // A 16-bit run's fp32 masters are finer than its 16-bit weights: an fp32 model takes them.
    const char* group = wide && r.has("master", p.name) ? "master" : "params";
    if (p.value.device() == Device::CPU) {
      r.read(group, p.name, p.shard, p.value);
      continue;
    }
    std::vector<char> host(p.value.bytes());
    r.read(group, p.name, p.shard, Tensor(host.data(), p.value.shape(), p.value.dtype()));
    copy_bytes(p.value.raw(), p.value.device(), host.data(), Device::CPU, host.size(), nullptr, true);
  }
}

// Where the kernels run: the host, or the first GPU (device.backend=cuda).
struct Execution {
  Device device = Device::CPU;
  KernelContext ctx;
#ifdef XIRANG_HAVE_CUDA
  std::unique_ptr<CudaContext> cuda;
#endif
};

void use_backend(const Config& cfg, Execution& b) {
  if (cfg.device.backend != Backend::CUDA) return;
#ifndef XIRANG_HAVE_CUDA
  (void)b;
  fail(ErrorKind::Config, "device.backend=cuda: this build has no CUDA backend (configure with -DXIRANG_CUDA=ON "
                          "on a machine with the CUDA toolkit), use device.backend=cpu");
#else
  if (!cuda_available())
    fail(ErrorKind::Config, "device.backend=cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the "
                            "driver), use device.backend=cpu");
  b.cuda = std::make_unique<CudaContext>(0);
  b.ctx = b.cuda->kernel_context();
  b.device = Device::CUDA;
#endif
}

// The whole model on one rank with the checkpoint's parameters; no memory for gradients.
struct LoadedModel {
  Arena params;
  std::unique_ptr<ModelChunk> chunk;
};

void load_model(LoadedModel& m, const ModelDims& dims, DType dtype, Device device, const CheckpointReader& reader) {
  m.chunk = model_arch(dims.arch).make_chunk(dims, ChunkPlacement::whole(dims.n_layer), dtype,
                                             ChunkBatch{.micro_batch = 1, .seq_len = 1}, TensorParallel{});
  Arena probe = Arena::measuring("parameters", device), no_grads = Arena::measuring("gradients", device);
  m.chunk->layout_parameters(probe, no_grads);
  m.params = Arena("parameters", probe.used(), device);
  no_grads = Arena::measuring("gradients", device);  // the gradients are never touched
  m.chunk->layout_parameters(m.params, no_grads);
  load_parameters(reader, *m.chunk, dims.arch);
}

struct Produced {
  int64_t tokens = 0;
  bool end_of_text = false;  // stopped at the tokenizer's end-of-text token
};

// Samples up to `budget` tokens after the prompt, writing each one's text
// to stdout as it comes, until `stop` (the end-of-text token; -1: none).
Produced sample_text(Decoder& dec, const KernelContext& ctx, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                     int64_t budget, const SamplingOptions& sampling, int32_t stop) {
  // Draws stay inside both vocabularies (a model may pad past the tokenizer's).
  const int64_t vocab = std::min<int64_t>(dec.dims().vocab_size, tok.vocab_size());
  Tensor logits = dec.forward(ctx, prompt.data(), int64_t(prompt.size()));
  Produced out;
  for (;;) {
    const std::vector<float> row = logits_to_host(ctx, logits, logits.size(0) - 1, vocab);
    const int32_t next = sample_token(row, sampling, uint64_t(out.tokens));
    ++out.tokens;
    if (next == stop) {
      out.end_of_text = true;
      return out;
    }
    const std::string text = tok.decode(&next, 1);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    if (out.tokens == budget) return out;
    logits = dec.forward(ctx, &next, 1);
  }
}

int generate(const GenerateArgs& args) {
  const Config cfg = load_config(args.config_path, args.overrides);
  const ModelDims& dims = cfg.model;
  check_layout(dims, ParallelLayout{});
  Execution backend;
  use_backend(cfg, backend);

  // The prompt first: its errors need neither the checkpoint nor the model.
  const std::unique_ptr<Tokenizer> tok = dataset_tokenizer(cfg);
  const std::vector<int32_t> prompt = tok->encode(args.prompt);
  if (prompt.empty()) fail(ErrorKind::Usage, "generate: --prompt is empty (expected some text to continue)");
  if (int64_t(prompt.size()) + 1 > dims.max_seq_len)
    fail(ErrorKind::Usage, "generate: --prompt is ", prompt.size(), " tokens (tokenizer ", tok->name(),
         "), but model.seq_len=", dims.max_seq_len, " leaves room for at most ", dims.max_seq_len - 1,
         " prompt tokens and one new one");

  const std::string step_dir = checkpoint_step_dir(args.checkpoint);
  const CheckpointReader reader = CheckpointReader::open(step_dir);
  LoadedModel model;
  load_model(model, dims, dtype_of(cfg.precision.dtype), backend.device, reader);
  std::unique_ptr<Decoder> dec = make_decoder(*model.chunk, backend.device);

  std::fwrite(args.prompt.data(), 1, args.prompt.size(), stdout);
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t budget = std::min<int64_t>(args.max_new_tokens, dims.max_seq_len - int64_t(prompt.size()));
  const Produced done =
      sample_text(*dec, backend.ctx, *tok, prompt, budget, args.sampling, args.ignore_eos ? -1 : tok->eot_token());
  const int64_t produced = done.tokens;
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (done.end_of_text)
    std::fprintf(stderr, "generate: stopped at the end-of-text token after %lld new tokens\n", (long long)produced);
  else if (produced < args.max_new_tokens)
    std::fprintf(stderr, "generate: stopped after %lld new tokens: the sequence filled model.seq_len=%d\n",
                 (long long)produced, dims.max_seq_len);
  std::fprintf(stderr, "generated %lld tokens after a %zu-token prompt in %.2f s (%.1f tokens/s) from %s (step %lld)\n",
               (long long)produced, prompt.size(), s, double(produced) / std::max(s, 1e-9), step_dir.c_str(),
               (long long)reader.step());
  return 0;
}

}  // namespace

int generate_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::fputs(kGenerateUsage, stdout);
      return 0;
    }
  const GenerateArgs args = parse_args(argc, argv);
  if (!launched_by_mpi()) return generate(args);
  MpiRuntime mpi(&argc, &argv);
  if (mpi.world_size() > 1) {
    if (mpi.world_rank() != 0) return 1;
    fail(ErrorKind::Usage, "generate runs on one rank, but the launcher started ", mpi.world_size(),
         " (run it without mpirun, or with -np 1; any layout's checkpoint loads)");
  }
  return generate(args);
}

}  // namespace xirang::tools
