// Hugging Face's layouts, both ways: a folder as `transformers` writes a
// GPT2LMHeadModel, a LlamaForCausalLM or a MixtralForCausalLM (config.json
// and model.safetensors)
// read into a Tessera model, and a Tessera model written as one that
// `transformers` loads.
//
// GPT-2: the same names (transformer.wte, transformer.h.N.attn.c_attn, ...),
// but GPT-2's Conv1D layers store their weights as [in, out] where Linear
// keeps [out, in]: the four per block (attn.c_attn, attn.c_proj, mlp.c_fc,
// mlp.c_proj) are transposed on the way in and out. The output layer is tied
// to wte (not stored), and "gelu_new" is GELU's tanh approximation
// (model.gelu tanh).
// Llama: the same names and layout (model.layers.N.self_attn.q_proj, ...);
// config.json carries the sizes, grouped-query heads, RMSNorm's epsilon and
// RoPE's base, and whether the output layer is tied.
// Mixtral: Llama's names with block_sparse_moe in place of mlp (its router
// gate, and experts.E.w1/w2/w3 for each expert E, which Tessera stacks as
// experts.w1/w2/w3 [E, ...]; nn/moe.h); config.json adds num_local_experts and
// num_experts_per_tok (a softmax router, the chosen weights rescaled to sum to 1).
#pragma once

#include <memory>
#include <string>

#include "nn/models.h"

namespace tessera::io {

// The model in an HF folder's config.json, as Tessera's configuration (arch
// gpt2 or llama, Mixtral being a llama with moe_experts; block_size: GPT-2's n_positions, Llama's
// max_position_embeddings), validated as any model is; throws naming the
// file and the field Tessera cannot take.
nn::TransformerConfig read_hf_config(const std::string& dir);
// Its weights under Tessera's names and layout, as float32 tensors (cfg: what
// read_hf_config returned): model.safetensors, or the shards that
// model.safetensors.index.json maps every tensor to.
nn::StateDict read_hf_weights(const std::string& dir, const nn::TransformerConfig& cfg);
// Writes `weights` (whole tensors by Tessera's names) as an HF folder:
// model.safetensors in float32 and config.json. gpt2 needs learned
// positions, biases and a tied output layer; llama takes any Tessera Llama.
void write_hf(const std::string& dir, const nn::TransformerConfig& cfg, const nn::StateDict& weights);
// Copies `weights` (Tessera's names) into `model` (plain tensors: a model not
// yet sharded; a sharded one takes them through fsdp::load_full_state_dict):
// every weight the model has must be there with its shape (a tied output layer
// is its embedding table), and none may be left over; errors name `source`.
void load_weights(nn::Module& model, const nn::StateDict& weights, bool tied, const std::string& source);
// read_hf_config, nn::make_model on `device` and load_weights in one call.
std::shared_ptr<nn::LanguageModel> load_hf_model(const std::string& dir, Device device = Device::cpu());

}  // namespace tessera::io
