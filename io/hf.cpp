#include "io/hf.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "nn/safetensors.h"
#include "runtime/check.h"
#include "runtime/json_scan.h"
#include "runtime/ops.h"

namespace tessera::io {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Whether a Tessera name is one of the four Conv1D weights of a block.
bool is_conv1d_weight(const std::string& name) {
  for (const char* suffix : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    const std::string s = suffix;
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
        name.rfind("transformer.h.", 0) == 0)
      return true;
  }
  return false;
}

// config.json and the index are a few KiB: anything far larger, or not a
// regular file, is not one of them.
constexpr uintmax_t kMaxJsonBytes = uintmax_t{64} << 20;

json read_json(const std::string& path) {
  std::error_code ec;
  TS_CHECK(fs::exists(path, ec), "Hugging Face model: cannot read {} (a folder as save_pretrained writes it holds "
           "config.json and model.safetensors)", path);
  TS_CHECK(fs::is_regular_file(path, ec), "Hugging Face model: {} is not a regular file", path);
  const uintmax_t size = fs::file_size(path, ec);
  TS_CHECK(!ec && size <= kMaxJsonBytes, "Hugging Face model: {} is {} bytes; a config or index is read up to {} MiB",
           path, size, kMaxJsonBytes >> 20);
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "Hugging Face model: cannot read {}", path);
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  check_json_nesting(text, "Hugging Face model: " + path);  // before anything copies or prints a value
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    TS_CHECK(false, "Hugging Face model: {} is not valid JSON: {}", path, e.what());
  }
  return {};
}

// A field of config.json of the type Tessera reads it as, or `fallback` where
// the file leaves it out (or sets it null); a value of another type is an
// error naming the file and the key, not the JSON library's.
std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 80) + "..." : s;
}
bool get_bool(const json& c, const char* key, bool fallback, const std::string& path) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  TS_CHECK(c[key].is_boolean(), "Hugging Face model: {}: \"{}\" must be true or false, got {}", path, key,
           shown(c[key]));
  return c[key].get<bool>();
}
double get_number(const json& c, const char* key, double fallback, const std::string& path) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  TS_CHECK(c[key].is_number(), "Hugging Face model: {}: \"{}\" must be a number, got {}", path, key, shown(c[key]));
  const double v = c[key].get<double>();
  TS_CHECK(std::isfinite(v), "Hugging Face model: {}: \"{}\" must be finite, got {}", path, key, shown(c[key]));
  return v;
}
std::string get_string(const json& c, const char* key, const std::string& fallback, const std::string& path) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  TS_CHECK(c[key].is_string(), "Hugging Face model: {}: \"{}\" must be a string, got {}", path, key, shown(c[key]));
  return c[key].get<std::string>();
}
// An integer field: absent (or null) is `fallback`; a fraction, a string or a
// value outside [1, 2^31) is an error naming it.
int64_t get_int(const json& c, const char* key, int64_t fallback, const std::string& path) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  const json& v = c[key];
  TS_CHECK(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
                                     std::abs(v.get<double>()) < 9e15),
           "Hugging Face model: {}: \"{}\" must be an integer, got {}", path, key, shown(v));
  const int64_t x = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
  TS_CHECK(x >= 1 && x < (int64_t{1} << 31), "Hugging Face model: {} needs \"{}\" as a positive integer, got {}{}",
           path, key, shown(v), x >= 1 ? " (at most 2^31 - 1)" : "");
  return x;
}
int64_t positive(const json& c, const char* key, const std::string& path) {
  TS_CHECK(c.contains(key) && !c[key].is_null(), "Hugging Face model: {} needs \"{}\" as a positive integer, got "
           "nothing", path, key);
  return get_int(c, key, 0, path);
}

}  // namespace

namespace {

void read_gpt2_config(nn::TransformerConfig& m, const json& c, const std::string& path) {
  m.arch = "gpt2";
  m.n_layer = positive(c, "n_layer", path);
  m.n_head = positive(c, "n_head", path);
  m.n_embd = positive(c, "n_embd", path);
  m.vocab_size = positive(c, "vocab_size", path);
  m.n_kv_head = 0;
  m.rope = false;
  m.bias = true;
  m.tie_embeddings = get_bool(c, "tie_word_embeddings", true, path);
  TS_CHECK(m.tie_embeddings, "Hugging Face GPT-2: {} unties the output layer (tie_word_embeddings false); "
           "Tessera reads GPT-2 with lm_head tied to wte", path);
  m.ffn_hidden = get_int(c, "n_inner", 0, path);  // null: 4 x n_embd
  const std::string act = get_string(c, "activation_function", "gelu_new", path);
  TS_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu",
           "Hugging Face GPT-2: {} has activation_function '{}'; Tessera's GPT-2 MLP takes gelu_new or "
           "gelu_pytorch_tanh (model.gelu tanh) and gelu (exact)", path, act);
  m.gelu_tanh = act != "gelu";
  const double eps = get_number(c, "layer_norm_epsilon", 1e-5, path);
  TS_CHECK(std::abs(eps - 1e-5) <= 1e-12, "Hugging Face GPT-2: {} has layer_norm_epsilon {}; Tessera's GPT-2 "
           "LayerNorm uses 1e-5", path, eps);
  TS_CHECK(get_bool(c, "scale_attn_weights", true, path) && !get_bool(c, "scale_attn_by_inverse_layer_idx", false, path) &&
               !get_bool(c, "reorder_and_upcast_attn", false, path),
           "Hugging Face GPT-2: {} changes the attention's scaling (scale_attn_weights false, "
           "scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn); Tessera's is 1/sqrt(head size)", path);
  m.dropout = 0.0;
  m.norm_eps = 1e-5;
  m.block_size = positive(c, "n_positions", path);  // the learned positions' table
}

// Llama's fields; Mixtral's are Llama's with its own RoPE base by default
// (1e6) and no attention_bias/mlp_bias fields.
void read_llama_config(nn::TransformerConfig& m, const json& c, const std::string& path, double default_theta = 10000.0) {
  m.arch = "llama";
  m.n_layer = positive(c, "num_hidden_layers", path);
  m.n_head = positive(c, "num_attention_heads", path);
  m.n_kv_head = get_int(c, "num_key_value_heads", m.n_head, path);
  m.n_embd = positive(c, "hidden_size", path);
  m.ffn_hidden = positive(c, "intermediate_size", path);
  m.vocab_size = positive(c, "vocab_size", path);
  m.tie_embeddings = get_bool(c, "tie_word_embeddings", false, path);
  m.bias = false;
  m.dropout = 0.0;
  TS_CHECK(!get_bool(c, "attention_bias", false, path) && !get_bool(c, "mlp_bias", false, path),
           "Hugging Face Llama: {} has attention_bias or mlp_bias; Tessera's Llama has no biases", path);
  const std::string act = get_string(c, "hidden_act", "silu", path);
  TS_CHECK(act == "silu", "Hugging Face Llama: {} has hidden_act '{}'; Tessera's Llama MLP is SwiGLU (silu)", path,
           act);
  const int64_t head_dim = get_int(c, "head_dim", m.n_embd / m.n_head, path);
  TS_CHECK(head_dim * m.n_head == m.n_embd,
           "Hugging Face Llama: {} has head_dim {} but hidden_size / num_attention_heads = {} / {}; Tessera's heads "
           "split hidden_size", path, head_dim, m.n_embd, m.n_head);
  m.norm_eps = get_number(c, "rms_norm_eps", 1e-6, path);
  // RoPE's base: rope_theta, or (transformers 5) rope_parameters.rope_theta;
  // scaled variants (Llama 3.1's "llama3", YaRN, ...) are not computed.
  const json* rope = c.contains("rope_parameters") && c["rope_parameters"].is_object() ? &c["rope_parameters"]
                     : c.contains("rope_scaling") && c["rope_scaling"].is_object()    ? &c["rope_scaling"]
                                                                                         : nullptr;
  const std::string type =
      rope != nullptr ? get_string(*rope, "rope_type", get_string(*rope, "type", "default", path), path) : "default";
  TS_CHECK(type == "default", "Hugging Face Llama: {} scales RoPE (rope_type '{}'); Tessera computes the "
           "unscaled rotation only", path, type);
  m.rope_theta = get_number(c, "rope_theta",
                            rope != nullptr ? get_number(*rope, "rope_theta", default_theta, path) : default_theta, path);
  m.block_size = positive(c, "max_position_embeddings", path);
}

// Mixtral (MixtralForCausalLM): a Llama whose every MLP is a mixture of
// num_local_experts SwiGLU experts, num_experts_per_tok per token by a softmax
// router whose chosen weights are rescaled to sum to 1 (nn/moe.h with
// moe_router softmax, moe_norm_topk, moe_every 1, no shared experts).
void read_mixtral_config(nn::TransformerConfig& m, const json& c, const std::string& path) {
  read_llama_config(m, c, path, 1e6);
  m.moe_experts = positive(c, "num_local_experts", path);
  m.moe_top_k = get_int(c, "num_experts_per_tok", 2, path);
  m.moe_hidden = m.ffn_hidden;
  m.moe_every = 1;
  m.moe_shared_experts = 0;
  m.moe_router = "softmax";
  m.moe_norm_topk = true;
  // Mixtral's balance loss when trained (output_router_logits); 0 is none.
  const double coeff = get_number(c, "router_aux_loss_coef", 0.001, path);
  TS_CHECK(coeff >= 0, "Hugging Face Mixtral: {}: \"router_aux_loss_coef\" must be >= 0, got {}", path, coeff);
  m.moe_balance = coeff > 0 ? "aux_loss" : "none";
  m.moe_balance_coeff = coeff;
  const double jitter = get_number(c, "router_jitter_noise", 0.0, path);
  TS_CHECK(jitter == 0, "Hugging Face Mixtral: {} has router_jitter_noise {}; Tessera's router adds no noise",
           path, jitter);
  // Attention within a window: the same as full attention when the window
  // covers every position.
  if (c.contains("sliding_window") && !c["sliding_window"].is_null()) {
    const int64_t window = get_int(c, "sliding_window", 0, path);
    TS_CHECK(window >= m.block_size, "Hugging Face Mixtral: {} has sliding_window {} below "
             "max_position_embeddings {}; Tessera's attention is over every earlier position", path, window,
             m.block_size);
  }
}

// Mixtral stores each expert's weights apart, as Linear weights
// (model.layers.N.block_sparse_moe.experts.E.w1.weight, [hidden, C]);
// Tessera stacks each of w1, w2, w3 on a leading expert dim
// (model.layers.N.block_sparse_moe.experts.w1, [E, hidden, C]), and keeps a
// bias balancing's selection offsets (expert_bias), which Mixtral has not: zero.
const std::regex& mixtral_expert_name() {
  static const std::regex re(R"((model\.layers\.(\d+)\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight)");
  return re;
}

void stack_experts(nn::StateDict& weights, const nn::TransformerConfig& cfg, const std::string& dir) {
  const int64_t E = cfg.moe_experts;
  std::map<std::string, std::vector<Tensor>> stacks;  // Tessera's name -> one tensor per expert
  nn::StateDict out;
  // transformers 5 holds (and may store) the experts fused: mlp.gate, and
  // mlp.experts.gate_up_proj [E, 2 hidden, C] (w1 then w3) and down_proj
  // [E, C, hidden] (w2).
  static const std::regex fused(R"((model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj))");
  for (auto& [name, t] : weights) {
    std::smatch m;
    if (std::regex_match(name, m, fused)) {
      const std::string moe = std::string(m[1]) + ".block_sparse_moe.";
      if (m[2] == "gate.weight") {
        out.emplace_back(moe + "gate.weight", t);
      } else if (m[2] == "experts.down_proj") {
        out.emplace_back(moe + "experts.w2", t);
      } else {
        TS_CHECK(t.dim() == 3 && t.size(1) % 2 == 0, "Hugging Face Mixtral: {}: {} is {}, expected [experts, "
                 "2 x intermediate_size, hidden_size]", dir, name, shape_str(t.shape()));
        const int64_t hidden = t.size(1) / 2;
        out.emplace_back(moe + "experts.w1", ops::contiguous(ops::narrow(t, 1, 0, hidden)));
        out.emplace_back(moe + "experts.w3", ops::contiguous(ops::narrow(t, 1, hidden, hidden)));
      }
      continue;
    }
    if (!std::regex_match(name, m, mixtral_expert_name())) {
      out.emplace_back(name, t);
      continue;
    }
    const std::string layer = m[2], expert = m[3];
    TS_CHECK(layer.size() <= 9 && std::stoll(layer) < cfg.n_layer && expert.size() <= 9 && std::stoll(expert) < E,
             "Hugging Face Mixtral: {} holds {}, but its config.json has {} layers of {} experts (num_hidden_layers, "
             "num_local_experts)", dir, name, cfg.n_layer, E);
    auto& stack = stacks[std::string(m[1]) + "." + std::string(m[4])];
    stack.resize(static_cast<size_t>(E));
    Tensor& slot = stack[static_cast<size_t>(std::stoll(expert))];
    TS_CHECK(!slot.defined(), "Hugging Face Mixtral: {} holds {} twice", dir, name);
    slot = t;
  }
  for (auto& [name, stack] : stacks) {
    const std::string expert_prefix = name.substr(0, name.size() - 2), w = name.substr(name.size() - 2);
    for (int64_t e = 0; e < E; ++e) {
      const Tensor& t = stack[static_cast<size_t>(e)];
      TS_CHECK(t.defined(), "Hugging Face Mixtral: {} has no {}{}.{}.weight (num_local_experts is {})", dir,
               expert_prefix, e, w, E);
      TS_CHECK(t.dim() == 2 && t.shape() == stack[0].shape(), "Hugging Face Mixtral: {}: {}{}.{}.weight is {}, "
               "expected a 2-D weight of expert 0's shape {}", dir, expert_prefix, e, w, shape_str(t.shape()),
               shape_str(stack[0].shape()));
    }
    out.emplace_back(name, ops::stack(stack, 0));
  }
  for (int64_t layer = 0; layer < cfg.n_layer; ++layer)
    if (cfg.is_moe_layer(layer))
      out.emplace_back(fmt::format("model.layers.{}.block_sparse_moe.expert_bias", layer), zeros({E}, DType::F32));
  weights = std::move(out);
}

}  // namespace

nn::TransformerConfig read_hf_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  const json c = read_json(path);
  TS_CHECK(c.is_object(), "Hugging Face model: {} must hold a JSON object", path);
  const std::string type = get_string(c, "model_type", "", path);
  nn::TransformerConfig m;
  if (type == "gpt2") read_gpt2_config(m, c, path);
  else if (type == "llama") read_llama_config(m, c, path);
  else if (type == "mixtral") read_mixtral_config(m, c, path);
  else
    TS_CHECK(false, "Hugging Face model: {} has model_type '{}'; Tessera reads gpt2 (GPT2LMHeadModel), llama "
             "(LlamaForCausalLM) and mixtral (MixtralForCausalLM)", path, type);
  // What any model must satisfy, checked before anything is built or written,
  // under the file's own names.
  const bool gpt2 = type == "gpt2";
  const std::map<std::string, std::string> keys = {
      {"n_layer", gpt2 ? "n_layer" : "num_hidden_layers"},  {"n_head", gpt2 ? "n_head" : "num_attention_heads"},
      {"n_embd", gpt2 ? "n_embd" : "hidden_size"},           {"n_kv_head", "num_key_value_heads"},
      {"ffn_hidden", gpt2 ? "n_inner" : "intermediate_size"}, {"vocab_size", "vocab_size"},
      {"block_size", gpt2 ? "n_positions" : "max_position_embeddings"},
      {"norm_eps", gpt2 ? "layer_norm_epsilon" : "rms_norm_eps"}, {"rope_theta", "rope_theta"},
      {"gelu_tanh", "activation_function"}, {"moe_experts", "num_local_experts"},
      {"moe_top_k", "num_experts_per_tok"}, {"moe_hidden", "intermediate_size"},
      {"moe_balance_coeff", "router_aux_loss_coef"}};
  const auto names = [&](const char* field) {
    auto it = keys.find(field);
    return fmt::format("Hugging Face model: {}'s \"{}\"", path, it != keys.end() ? it->second : field);
  };
  m.check_file_claims(names);
  m.validate(names);
  return m;
}

nn::StateDict read_hf_weights(const std::string& dir, const nn::TransformerConfig& cfg) {
  // One model.safetensors, or the shards model.safetensors.index.json names
  // (save_pretrained splits models above its max_shard_size, 5 GB by default).
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  std::map<std::string, std::vector<std::string>> shards;  // file -> the tensors the index puts there
  if (fs::is_regular_file(single)) {
    shards[single] = {};
  } else {
    TS_CHECK(fs::is_regular_file(index), "Hugging Face model: {} has neither model.safetensors nor "
             "model.safetensors.index.json (a sharded model)", dir);
    json idx = read_json(index);
    TS_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object() &&
                 !idx["weight_map"].empty(),
             "Hugging Face model: {} has no \"weight_map\" of tensor names to files", index);
    for (const auto& [name, file] : idx["weight_map"].items()) {
      TS_CHECK(file.is_string(), "Hugging Face model: {}: weight_map[\"{}\"] is {}, expected a file name", index,
               name, file.dump());
      std::string f = file.get<std::string>();
      TS_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
               "Hugging Face model: {}: weight_map[\"{}\"] is '{}', expected a file in the same folder", index,
               name, f);
      TS_CHECK(fs::is_regular_file(fs::path(dir) / f), "Hugging Face model: {} puts {} in {}, which does not exist",
               index, name, f);
      shards[(fs::path(dir) / f).string()].push_back(name);
    }
  }
  const bool gpt2 = cfg.arch == "gpt2";
  nn::StateDict out;
  for (const auto& [path, listed] : shards) {
    nn::SafetensorsFile f(path);
    if (!listed.empty()) {  // the index and its shards agree, both ways
      for (const auto& name : listed)
        TS_CHECK(f.find(name) != nullptr, "Hugging Face model: the index puts {} in {}, which lacks it", name, path);
      for (const auto& e : f.entries())
        TS_CHECK(std::find(listed.begin(), listed.end(), e.name) != listed.end(),
                 "Hugging Face model: {} holds {}, which the index puts elsewhere or not at all", path, e.name);
    }
    for (const auto& e : f.entries()) {
      // The causal-mask buffers older versions stored are not weights.
      // Older Llama checkpoints stored RoPE's inverse frequencies, which Tessera computes.
      if (!gpt2 && e.name.find("rotary_emb.inv_freq") != std::string::npos) continue;
      if (gpt2 && e.name.size() > 10 && (e.name.compare(e.name.size() - 10, 10, ".attn.bias") == 0 ||
                                         e.name.find(".attn.masked_bias") != std::string::npos))
        continue;
      Tensor t = f.read(e.name, DType::F32);
      if (gpt2 && is_conv1d_weight(e.name)) {
        TS_CHECK(t.dim() == 2, "Hugging Face GPT-2: {}: {} should be a 2-D Conv1D weight, got {}", path, e.name,
                 shape_str(t.shape()));
        t = ops::contiguous(ops::transpose(t, 0, 1));  // Conv1D [in, out] -> Linear [out, in]
      }
      // Checkpoints saved from GPT2Model rather than GPT2LMHeadModel lack the "transformer." prefix.
      std::string name = e.name;
      if (gpt2 && name.rfind("transformer.", 0) != 0 && name.rfind("lm_head.", 0) != 0) name = "transformer." + name;
      out.emplace_back(name, t);
    }
  }
  if (cfg.is_moe()) stack_experts(out, cfg, dir);
  // A tied output layer is its embedding table: named under both, as the
  // model's state dict has it. A file that also stores a different lm_head
  // contradicts its own config.json, and is refused rather than read as either.
  if (cfg.tie_embeddings) {
    const std::string table = gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
    auto find = [&](const std::string& name) {
      return std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == name; });
    };
    auto embedding = find(table), head = find("lm_head.weight");
    TS_CHECK(embedding != out.end(), "Hugging Face model: {} has no {}", dir, table);
    if (head == out.end()) {
      out.emplace_back("lm_head.weight", embedding->second);
    } else {
      const bool same = head->second.shape() == embedding->second.shape() &&
                        ops::sum(ops::binary(ops::BinaryOp::Ne, head->second, embedding->second), {}, false, DType::F64)
                                .item() == 0;
      TS_CHECK(same,
               "Hugging Face model: {}'s config.json ties the output layer to the embedding (tie_word_embeddings), "
               "but its weights hold an lm_head.weight that differs from {}; untie it in config.json, or drop "
               "lm_head.weight", dir, table);
    }
  }
  return out;
}

void load_weights(nn::Module& model, const nn::StateDict& weights, bool tied, const std::string& source) {
  std::map<std::string, Tensor> by_name(weights.begin(), weights.end());
  autograd::NoGradGuard no_grad;
  size_t used = 0;
  for (auto& [name, dest] : model.state_dict()) {
    auto it = by_name.find(name);
    if (it == by_name.end() && name == "lm_head.weight" && tied) continue;
    TS_CHECK(it != by_name.end(), "{} has no {} (the model its settings describe needs it)", source, name);
    TS_CHECK(it->second.shape() == dest.shape(), "{}: {} is {}, but the model its settings describe needs {}",
             source, name, shape_str(it->second.shape()), shape_str(dest.shape()));
    ops::copy_(dest, it->second);
    ++used;
  }
  TS_CHECK(used == weights.size(), "{} holds {} tensors, of which the model its settings describe uses {}", source,
           weights.size(), used);
}

void write_hf(const std::string& dir, const nn::TransformerConfig& m, const nn::StateDict& weights) {
  const bool gpt2 = m.arch == "gpt2";
  TS_CHECK(!gpt2 || (!m.rope && m.bias && m.tie_embeddings),
           "Hugging Face GPT-2 export: the model must be gpt2 with learned positions, biases and a tied output "
           "layer (arch {}, rope {}, bias {}, tie_embeddings {})",
           m.arch, m.rope, m.bias, m.tie_embeddings);
  // A mixture of experts is written as Mixtral, which has one kind: every
  // layer's MLP routed by softmax to top-k experts whose weights sum to 1.
  TS_CHECK(!m.is_moe() || (m.moe_every == 1 && m.moe_shared_experts == 0 && m.moe_router == "softmax" &&
                           m.moe_norm_topk),
           "Hugging Face export: a mixture of experts is written as Mixtral (MixtralForCausalLM), whose every layer "
           "routes by softmax to top-k experts with the chosen weights rescaled, and has no shared experts; this "
           "model has moe_every {}, moe_shared_experts {}, moe_router {}, moe_norm_topk {}",
           m.moe_every, m.moe_shared_experts, m.moe_router, m.moe_norm_topk);
  fs::create_directories(dir);
  std::vector<nn::SafetensorsEntry> entries;
  std::vector<Tensor> tensors;
  uint64_t offset = 0;
  auto add = [&](const std::string& name, const Tensor& t) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * 4;
    entries.push_back({name, DType::F32, t.shape(), offset, offset + bytes});
    tensors.push_back(t);
    offset += bytes;
  };
  int64_t expert_hidden = 0;
  for (const auto& [name, value] : weights) {
    if (name == "lm_head.weight" && m.tie_embeddings) continue;  // tied to the embedding table
    Tensor t = ops::contiguous(ops::to(value, DType::F32));
    if (gpt2 && is_conv1d_weight(name)) t = ops::contiguous(ops::transpose(t, 0, 1));
    static const std::string bias_suffix = ".block_sparse_moe.expert_bias";
    if (m.is_moe() && name.size() > bias_suffix.size() &&
        name.compare(name.size() - bias_suffix.size(), bias_suffix.size(), bias_suffix) == 0) {
      // Selection offsets Mixtral's router does not have: only a model whose are all zero routes the same there.
      TS_CHECK(ops::sum(ops::binary(ops::BinaryOp::Ne, t, zeros(t.shape(), DType::F32)), {}, false, DType::F64)
                       .item() == 0,
               "Hugging Face export: {} is not zero (moe_balance bias moved it); Mixtral's router has no such "
               "offsets, so it would choose other experts than this model", name);
      continue;
    }
    static const std::regex stacked(R"((model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123]))");
    std::smatch match;
    if (m.is_moe() && std::regex_match(name, match, stacked)) {  // [E, ...] -> one weight per expert
      TS_CHECK(t.dim() == 3 && t.size(0) == m.moe_experts, "Hugging Face export: {} is {}, expected [{}, ., .]",
               name, shape_str(t.shape()), m.moe_experts);
      if (match[2] == "w1") expert_hidden = t.size(1);
      for (int64_t e = 0; e < t.size(0); ++e)
        add(fmt::format("{}.{}.{}.weight", std::string(match[1]), e, std::string(match[2])),
            ops::contiguous(ops::select(t, 0, e)));
      continue;
    }
    add(name, t);
  }
  nn::write_safetensors((fs::path(dir) / "model.safetensors").string(), entries,
                        [&](size_t i) { return tensors[i]; }, {{"format", "pt"}});
  json c;
  if (gpt2) {
    c = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"activation_function", m.gelu_tanh ? "gelu_new" : "gelu"},
         {"n_layer", m.n_layer},
         {"n_head", m.n_head},
         {"n_embd", m.n_embd},
         {"n_inner", m.ffn_hidden > 0 ? json(m.ffn_hidden) : json(nullptr)},
         {"n_positions", m.block_size},
         {"vocab_size", m.vocab_size},
         {"layer_norm_epsilon", m.norm_eps},
         {"tie_word_embeddings", true},
         {"resid_pdrop", m.dropout},
         {"embd_pdrop", m.dropout},
         {"attn_pdrop", m.dropout},
         {"scale_attn_weights", true},
         {"torch_dtype", "float32"}};
    // GPT-2's end-of-text token where the vocabulary has it (byte-token models do not).
    c["bos_token_id"] = c["eos_token_id"] = m.vocab_size > 50256 ? json(50256) : json(nullptr);
  } else {
    // Llama's fields, which Mixtral shares; the MLP's width (each expert's
    // for Mixtral) as the weights have it (model.ffn_hidden 0 means the model chose it).
    int64_t hidden = expert_hidden;
    if (m.is_moe()) {
      TS_CHECK(hidden > 0, "Hugging Face Mixtral export: the weights have no model.layers.N.block_sparse_moe.experts.w1");
    } else {
      auto gate = std::find_if(weights.begin(), weights.end(),
                               [](const auto& e) { return e.first == "model.layers.0.mlp.gate_proj.weight"; });
      TS_CHECK(gate != weights.end(),
               "Hugging Face Llama export: the weights have no model.layers.0.mlp.gate_proj.weight");
      hidden = gate->second.size(0);
    }
    c = {{"architectures", {m.is_moe() ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
         {"model_type", m.is_moe() ? "mixtral" : "llama"},
         {"hidden_act", "silu"},
         {"num_hidden_layers", m.n_layer},
         {"num_attention_heads", m.n_head},
         {"num_key_value_heads", m.n_kv_head > 0 ? m.n_kv_head : m.n_head},
         {"head_dim", m.n_embd / m.n_head},
         {"hidden_size", m.n_embd},
         {"intermediate_size", hidden},
         {"max_position_embeddings", m.block_size},
         {"vocab_size", m.vocab_size},
         {"rms_norm_eps", m.norm_eps},
         {"rope_theta", m.rope_theta},
         {"tie_word_embeddings", m.tie_embeddings},
         {"attention_dropout", 0.0},
         {"bos_token_id", nullptr},
         {"eos_token_id", nullptr},
         {"torch_dtype", "float32"}};
    if (m.is_moe()) {
      c["num_local_experts"] = m.moe_experts;
      c["num_experts_per_tok"] = m.moe_top_k;
      // The balance loss's weight when transformers trains it (output_router_logits).
      c["router_aux_loss_coef"] = m.moe_balance == "aux_loss" ? m.moe_balance_coefficient() : 0.0;
      c["output_router_logits"] = false;
      c["router_jitter_noise"] = 0.0;
      c["sliding_window"] = nullptr;
    } else {
      c["attention_bias"] = false;
      c["mlp_bias"] = false;
    }
  }
  std::ofstream((fs::path(dir) / "config.json").string()) << c.dump(2) << "\n";
}

std::shared_ptr<nn::LanguageModel> load_hf_model(const std::string& dir, Device device) {
  const nn::TransformerConfig cfg = read_hf_config(dir);
  auto model = nn::make_model(cfg, Device::meta());
  const nn::StateDict weights = read_hf_weights(dir, cfg);
  load_weights(*model, weights, cfg.tie_embeddings, dir);  // on meta: the names and shapes, before any memory
  model->to_empty(device);
  load_weights(*model, weights, cfg.tie_embeddings, dir);
  return model;
}

}  // namespace tessera::io
