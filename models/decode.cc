#include "models/decode.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/device_memory.h"
#include "core/error.h"
#include "core/rng.h"

namespace xirang {

Decoder::Decoder(const ModelChunk& chunk, Device device, int logits_rows)
    : dims_(chunk.dims()),
      dtype_(chunk.dtype()),
      wide_(chunk.grad_dtype()),
      device_(device),
      logits_rows_(logits_rows) {
  XR_CHECK(logits_rows >= 1 && logits_rows <= dims_.max_seq_len, "Decoder: logits_rows ", logits_rows,
           " must be in [1, max_seq_len ", dims_.max_seq_len, "]");
}

void Decoder::carve(Arena& arena) {
  tokens_ = arena.alloc({max_len()}, DType::I32, "decode tokens");
  logits_ = arena.alloc({logits_rows_, dims_.padded_vocab()}, dtype_, "decode logits");
  layout(arena);
}

void Decoder::allocate() {
  Arena probe = Arena::measuring("decode", device_);
  carve(probe);
  arena_ = Arena("decode", probe.used(), device_);
  carve(arena_);
}

Tensor Decoder::forward(const KernelContext& ctx, const int32_t* tokens, int64_t n) {
  if (n < 1 || pos_ + n > max_len())
    fail(ErrorKind::Usage, "decode: ", n, " new tokens after ", pos_, " would need ", pos_ + n,
         " positions, but the model sees at most ", max_len(), " (model.seq_len)");
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= dims_.vocab_size)
      fail(ErrorKind::Usage, "decode: token ", tokens[i], " at position ", pos_ + i, " is outside the vocabulary [0, ",
           dims_.vocab_size, ")");
  Tensor tok = tokens_.slice(0, n);
  copy_bytes(tok.raw(), device_, tokens, Device::CPU, size_t(n) * sizeof(int32_t), ctx.cuda_stream, false);
  Tensor logits = logits_.slice(0, std::min<int64_t>(n, logits_rows_));
  run(ctx, tok, n, pos_, logits);
  pos_ += n;
  return logits;
}

std::unique_ptr<Decoder> make_decoder(ModelChunk& chunk, Device device, int logits_rows) {
  const ModelDims& d = chunk.dims();
  const ChunkPlacement& at = chunk.placement();
  if (!(at.has_embedding && at.has_head && at.first_layer == 0 && at.end_layer == d.n_layer))
    fail(ErrorKind::Config, "generation needs the whole model in one chunk (layers [0, ", d.n_layer,
         ") with the embedding and the head); this chunk holds layers [", at.first_layer, ", ", at.end_layer, ")");
  for (const Parameter& p : chunk.parameters())
    if (p.value.shape() != p.shard.global)
      fail(ErrorKind::Config, "generation runs on one rank: parameter '", p.name, "' is a tensor-parallel shard ",
           p.value.shape().str(), " of ", p.shard.global.str());
  const ModelArch& arch = model_arch(d.arch);
  if (!arch.make_decoder) fail(ErrorKind::Config, "model.arch='", d.arch, "' has no decoder for generation");
  return arch.make_decoder(chunk, device, logits_rows);
}

std::vector<float> logits_to_host(const KernelContext& ctx, const Tensor& logits, int64_t row, int64_t n) {
  XR_CHECK(logits.rank() == 2 && 0 <= row && row < logits.size(0) && 0 <= n && n <= logits.size(1),
           "logits_to_host: row ", row, ", ", n, " values of ", logits.str());
  const size_t e = dtype_size(logits.dtype());
  std::vector<char> raw(size_t(n) * e);
  copy_bytes(raw.data(), Device::CPU, static_cast<const char*>(logits.raw()) + size_t(row * logits.size(1)) * e,
             logits.device(), raw.size(), ctx.cuda_stream, true);
  std::vector<float> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) switch (logits.dtype()) {
      case DType::F32: out[i] = reinterpret_cast<const float*>(raw.data())[i]; break;
      case DType::F64: out[i] = float(reinterpret_cast<const double*>(raw.data())[i]); break;
      case DType::BF16: out[i] = bf16_to_float(reinterpret_cast<const bf16*>(raw.data())[i]); break;
      case DType::F16: out[i] = f16_to_float(reinterpret_cast<const f16*>(raw.data())[i]); break;
      default: fail(ErrorKind::Shape, "logits_to_host: logits of dtype ", dtype_name(logits.dtype()));
    }
  return out;
}

int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& o, uint64_t draw) {
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    fail(ErrorKind::Usage, "sampling: temperature ", o.temperature, " must be a finite number >= 0 (0: greedy)");
  if (o.top_k < 0) fail(ErrorKind::Usage, "sampling: top-k ", o.top_k, " must be >= 0 (0: the whole vocabulary)");
  XR_CHECK(!logits.empty(), "sample_token: no logits");
  const int64_t V = int64_t(logits.size());
  // Candidates by decreasing logit, the lower id first on a tie: a total order.
  auto before = [&](int64_t a, int64_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  if (o.temperature == 0 || o.top_k == 1) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (before(i, best)) best = i;
    return int32_t(best);
  }
  const int64_t k = o.top_k == 0 ? V : std::min<int64_t>(o.top_k, V);
  std::vector<int64_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), int64_t(0));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
  ids.resize(size_t(k));
  const double top = logits[size_t(ids[0])];
  std::vector<double> w(static_cast<size_t>(k));
  double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    w[size_t(i)] = std::exp((double(logits[size_t(ids[size_t(i)])]) - top) / o.temperature);
    total += w[size_t(i)];
  }
  // The stream separates sampling draws from every other use of the seed.
  const double u = rng_uniform(o.seed, name_stream("xirang.sample"), draw) * total;
  double cum = 0;
  for (int64_t i = 0; i < k; ++i) {
    cum += w[size_t(i)];
    if (u < cum) return int32_t(ids[size_t(i)]);
  }
  return int32_t(ids[size_t(k - 1)]);  // u rounded up to the total
}

}  // namespace xirang
