// models/gpt2/gpt2_files.h: GPT-2's names and layouts in Hugging Face and
// llm.c model files (the ModelFileAdapter of model.arch=gpt2).
//
// Hugging Face (GPT2LMHeadModel): our names with a "transformer." prefix
// (imports also accept them without); the Conv1D matrices of the blocks
// (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj weights) stored (in, out),
// ours (out, in); the token table with vocab_size rows, ours padded;
// lm_head.weight a copy of the token table (tied), left out of exports;
// the causal-mask buffers h.{i}.attn.bias and masked_bias ignored.
//
// llm.c (gpt2_124M.bin): header ints 2-7 are max_seq_len, vocab_size,
// n_layer, n_head, channels, padded_vocab_size; then wte (padded rows of
// the file's own padding), wpe, each block tensor for all layers in turn,
// ln_f; matrices (out, in) like ours.
//
//   ModelArch a = ...;
//   a.files = &gpt2_file_adapter();
#pragma once

#include "models/file_adapter.h"

namespace xirang {

const ModelFileAdapter& gpt2_file_adapter();

}  // namespace xirang
