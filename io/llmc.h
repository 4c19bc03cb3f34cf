// llm.c's GPT-2 checkpoint (gpt2_124M.bin, train_gpt2.c's model files), both
// ways, so that a model trained by either continues in the other.
//
// The file: a header of 256 little-endian int32 (magic 20240326; version 3
// for float32 parameters, 5 for bfloat16; max_seq_len, vocab_size,
// num_layers, num_heads, channels, padded_vocab_size), then the 16 parameter
// tensors back to back in llm.c's order, each layer's stacked along a
// leading L: wte (Vp, C), wpe (maxT, C), ln1w, ln1b (L, C), qkvw (L, 3C, C),
// qkvb (L, 3C), attprojw (L, C, C), attprojb (L, C), ln2w, ln2b (L, C),
// fcw (L, 4C, C), fcb (L, 4C), fcprojw (L, C, 4C), fcprojb (L, C), lnfw,
// lnfb (C). Weights are [out, in] as Tessera's Linear; wte's rows past the
// vocabulary (padding to Vp) are zeros. llm.c's GPT-2 has biases, a tied
// output layer, learned positions, a 4C MLP and GELU's tanh approximation.
#pragma once

#include <string>

#include "nn/transformer.h"

namespace tessera::io {

// The model's configuration (block_size = max_seq_len) and weights (by
// Tessera's names, float32) of an llm.c model file; every size and the file's
// length are checked against the header, naming what differs.
nn::StateDict read_llmc_model(nn::TransformerConfig& cfg, const std::string& path);
// Writes whole tensors by Tessera's names as an llm.c model file, in float32
// (version 3) or bfloat16 (version 5); the model must be one llm.c computes.
void write_llmc_model(const std::string& path, const nn::TransformerConfig& cfg, const nn::StateDict& weights,
                      DType dtype);

}  // namespace tessera::io
