// Hugging Face's GPT-2 layout, both ways: a folder as `transformers` writes a
// GPT2LMHeadModel (config.json and model.safetensors) read into a Tessera
// GPT, and a Tessera GPT written as one that `transformers` loads.
//
// The two models compute the same function with the same names
// (transformer.wte, transformer.h.N.attn.c_attn, ...), but GPT-2's Conv1D
// layers store their weights as [in, out] where Linear keeps [out, in]: the
// four per block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are
// transposed on the way in and out. The output layer is tied to wte (not
// stored), and "gelu_new" is GELU's tanh approximation (model.gelu tanh).
#pragma once

#include <string>

#include "nn/module.h"
#include "tools/config.h"

namespace tessera::tools {

// The [model] settings (and training.seq_len = n_positions) of the GPT-2 in
// an HF folder's config.json; throws naming the field Tessera cannot take.
void read_hf_gpt2_config(TrainConfig& cfg, const std::string& dir);
// Its weights under Tessera's names and layout, as float32 tensors.
nn::StateDict read_hf_gpt2_weights(const std::string& dir);
// Writes `weights` (whole tensors by Tessera's names, of a gpt2 model with
// learned positions) as an HF GPT-2 folder: model.safetensors in float32
// and config.json.
void write_hf_gpt2(const std::string& dir, const TrainConfig& cfg, const nn::StateDict& weights);

}  // namespace tessera::tools
