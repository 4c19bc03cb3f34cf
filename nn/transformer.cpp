#include "nn/transformer.h"

#include <cmath>
#include <tuple>

#include "nn/moe.h"
#include "runtime/checked.h"

namespace tessera::nn {

int64_t TransformerConfig::mlp_hidden() const {
  if (ffn_hidden > 0) return ffn_hidden;
  return arch == "llama" ? (8 * n_embd / 3 + 63) / 64 * 64 : 4 * n_embd;
}

void TransformerConfig::validate(const FieldNames& names) const {
  auto f = [&](const char* field) { return field_name(names, field); };
  auto at_least = [&](const char* field, int64_t v, int64_t min, const char* note = "") {
    TS_CHECK(v >= min, "{} must be >= {}{}, got {}", f(field), min, note, v);
  };
  TS_CHECK(arch == "gpt2" || arch == "llama", "{}: expected gpt2 or llama, got '{}'", f("arch"), arch);
  at_least("n_layer", n_layer, 1);
  at_least("n_head", n_head, 1);
  at_least("n_embd", n_embd, 1);
  at_least("vocab_size", vocab_size, 1);
  at_least("block_size", block_size, 1);
  at_least("n_kv_head", n_kv_head, 0, fmt::format(" (0 = {})", f("n_head")).c_str());
  at_least("ffn_hidden", ffn_hidden, 0, fmt::format(" (0 = the default of {})", f("arch")).c_str());
  TS_CHECK(n_embd % n_head == 0,
           "{} ({}) must be divisible by {} ({}): each head has n_embd / n_head channels", f("n_embd"), n_embd,
           f("n_head"), n_head);
  if (arch == "llama") {
    TS_CHECK(n_head % kv_heads() == 0,
             "{} ({}) must divide {} ({}): each key/value head serves n_head / n_kv_head query heads",
             f("n_kv_head"), n_kv_head, f("n_head"), n_head);
    TS_CHECK(head_dim() % 2 == 0,
             "{} = llama needs an even head size for rotary embeddings, but {} / {} = {} / {} = {}", f("arch"),
             f("n_embd"), f("n_head"), n_embd, n_head, head_dim());
    TS_CHECK(!gelu_tanh, "{} applies to {} = gpt2 (Llama's MLP is SwiGLU, without GELU)", f("gelu_tanh"), f("arch"));
  } else {
    TS_CHECK(!rope || head_dim() % 2 == 0, "{} needs an even head size, but {} / {} = {} / {} = {}", f("rope"),
             f("n_embd"), f("n_head"), n_embd, n_head, head_dim());
    TS_CHECK(n_kv_head == 0 || n_kv_head == n_head,
             "{} ({}) applies to {} = llama only ({} has {} = {} key/value heads): leave it 0", f("n_kv_head"),
             n_kv_head, f("arch"), arch, f("n_head"), n_head);
  }
  TS_CHECK(dropout >= 0 && dropout < 1, "{} must be in [0, 1), got {}", f("dropout"), dropout);
  TS_CHECK(rope_theta > 0, "{} must be > 0, got {}", f("rope_theta"), rope_theta);
  TS_CHECK(norm_eps > 0 && norm_eps < 1, "{} must be in (0, 1), got {}", f("norm_eps"), norm_eps);
  at_least("moe_experts", moe_experts, 0, " (0 = dense)");
  if (is_moe()) {
    TS_CHECK(arch == "llama", "{} applies to {} = llama (a mixture of SwiGLU experts), got {}", f("moe_experts"),
             f("arch"), arch);
    TS_CHECK(moe_top_k >= 1 && moe_top_k <= moe_experts, "{} must be in [1, {} = {}], got {}", f("moe_top_k"),
             f("moe_experts"), moe_experts, moe_top_k);
    at_least("moe_shared_experts", moe_shared_experts, 0);
    TS_CHECK(moe_every >= 1 && moe_every <= n_layer, "{} must be in [1, {} = {}], got {}", f("moe_every"),
             f("n_layer"), n_layer, moe_every);
    at_least("moe_hidden", moe_hidden, 0, " (0 = the dense MLP's width)");
    TS_CHECK(moe_router == "softmax" || moe_router == "sigmoid", "{}: expected softmax or sigmoid, got '{}'",
             f("moe_router"), moe_router);
    TS_CHECK(moe_balance == "none" || moe_balance == "aux_loss" || moe_balance == "bias",
             "{}: expected none, aux_loss or bias, got '{}'", f("moe_balance"), moe_balance);
    TS_CHECK(std::isfinite(moe_balance_coeff) && moe_balance_coeff >= 0,
             "{} must be >= 0 (0 = the method's default), got {}", f("moe_balance_coeff"), moe_balance_coeff);
    TS_CHECK(!activation_checkpoint,
             "{} with {} > 0: a recomputed MoE layer would route twice and lose its balance loss's gradient; "
             "not supported yet", f("activation_checkpoint"), f("moe_experts"));
  }
  TS_CHECK(ac_layer_frequency >= 1, "{} must be >= 1 (1: every block), got {}", f("ac_layer_frequency"),
           ac_layer_frequency);
  parameter_count(names);
}

int64_t TransformerConfig::active_parameter_count() const {
  const int64_t idle = is_moe() ? moe_layer_count() * (moe_experts - moe_top_k) * 3 * n_embd * moe_width() : 0;
  return parameter_count() - idle;
}

void TransformerConfig::check_file_claims(const FieldNames& names) const {
  TS_CHECK(n_layer <= kMaxLayers, "{} is {}; a model read from a file has at most {} layers (the deepest trained "
           "have a few hundred)", field_name(names, "n_layer"), n_layer, kMaxLayers);
}

int64_t TransformerConfig::parameter_count(const FieldNames& names) const {
  auto key = [&](const char* field, int64_t v) { return named(field_name(names, field), v); };
  const CheckedInt C = key("n_embd", n_embd), V = key("vocab_size", vocab_size), L = key("n_layer", n_layer);
  const CheckedInt zero{0, "0"};
  CheckedInt embeddings = V * C;
  const CheckedInt head = tie_embeddings ? zero : C * V;
  const CheckedInt norm = arch == "llama" || !bias ? C : 2 * C;  // weight (and bias)
  CheckedInt block;
  if (arch == "llama") {
    const CheckedInt kv = n_kv_head > 0 ? key("n_kv_head", n_kv_head) : key("n_head", n_head);
    const CheckedInt hidden = ffn_hidden > 0 ? key("ffn_hidden", ffn_hidden)
                                             : CheckedInt{((8 * C).value / 3 + 63) / 64 * 64, C.expr + " x 8/3"};
    // q and o: C x C; k and v: C x (n_kv_head x head size).
    const CheckedInt kv_width{n_embd / n_head * kv.value, C.expr + " / " + field_name(names, "n_head") + " x " + kv.expr};
    const CheckedInt attention_and_norms = 2 * (C * C) + 2 * (C * kv_width) + 2 * C;
    block = attention_and_norms + 3 * (C * hidden);
    if (is_moe()) {
      // An MoE layer: the router, the experts and the shared experts in place of the MLP.
      const CheckedInt E = key("moe_experts", moe_experts), S = key("moe_shared_experts", moe_shared_experts);
      const CheckedInt width = moe_hidden > 0 ? key("moe_hidden", moe_hidden) : hidden;
      const CheckedInt moe_block = attention_and_norms + C * E + (E + S) * (3 * (C * width));
      const CheckedInt moe_layers{moe_layer_count(), "the MoE layers"}, dense{n_layer - moe_layer_count(), "the dense layers"};
      return (embeddings + dense * block + moe_layers * moe_block + norm + head).value;
    }
  } else {
    const CheckedInt hidden = ffn_hidden > 0 ? key("ffn_hidden", ffn_hidden) : 4 * C;
    const CheckedInt biases = bias ? 3 * C + C + hidden + C : zero;  // c_attn, attn c_proj, c_fc, mlp c_proj
    block = 4 * (C * C) + 2 * (C * hidden) + biases + 2 * norm;
    if (!rope) embeddings = embeddings + key("block_size", block_size) * C;  // transformer.wpe
  }
  return (embeddings + L * block + norm + head).value;
}

Tensor maybe_checkpoint(bool on, bool save_matmuls, const Tensor& x, const std::function<Tensor(const Tensor&)>& f) {
  if (!on || !autograd::is_grad_enabled()) return f(x);
  // The segment runs again in backward: capture f by value.
  return autograd::checkpoint([f](const TensorList& in) { return TensorList{f(in[0])}; }, {x},
                              {.save_matmuls = save_matmuls})[0];
}

// Residual projections get the GPT-2 scaled init std 0.02 / sqrt(2 * n_layer).
double TransformerConfig::residual_std() const {
  return 0.02 / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(n_layer, 1)));
}

GeluMLP::GeluMLP(const TransformerConfig& cfg, Device device) {
  int64_t hidden = cfg.ffn_hidden > 0 ? cfg.ffn_hidden : 4 * cfg.n_embd;
  c_fc = register_module("c_fc", std::make_shared<Linear>(cfg.n_embd, hidden, cfg.bias, device));
  c_proj = register_module("c_proj", std::make_shared<Linear>(hidden, cfg.n_embd, cfg.bias, device));
  c_proj->init_std = cfg.residual_std();
  dropout = register_module("dropout", std::make_shared<Dropout>(cfg.dropout));
  tanh_approximation = cfg.gelu_tanh;
}

Tensor GeluMLP::forward(const Tensor& x) {
  // Exact GELU as nanoGPT, or the tanh approximation GPT-2 was trained with.
  return (*dropout)((*c_proj)(gelu((*c_fc)(x), tanh_approximation)));
}

SwiGLUMLP::SwiGLUMLP(const TransformerConfig& cfg, Device device) {
  int64_t hidden = cfg.ffn_hidden;
  if (hidden <= 0) hidden = (8 * cfg.n_embd / 3 + 63) / 64 * 64;
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(cfg.n_embd, hidden, false, device));
  up_proj = register_module("up_proj", std::make_shared<Linear>(cfg.n_embd, hidden, false, device));
  down_proj = register_module("down_proj", std::make_shared<Linear>(hidden, cfg.n_embd, false, device));
  down_proj->init_std = cfg.residual_std();
}

Tensor SwiGLUMLP::forward(const Tensor& x) {
  return (*down_proj)(swiglu((*gate_proj)(x), (*up_proj)(x)));  // silu(gate) * up, fused
}

namespace {
// cos/sin [positions, head_dim/2] of angle(pos, i) = pos * theta^(-2i / head_dim), computed in f64.
std::pair<Tensor, Tensor> rotary_rows(const std::vector<int64_t>& positions, int64_t head_dim, double theta,
                                      DType dtype, Device device) {
  const int64_t half = head_dim / 2, t = static_cast<int64_t>(positions.size());
  std::vector<double> c(static_cast<size_t>(t * half)), s(c.size());
  for (int64_t r = 0; r < t; ++r)
    for (int64_t i = 0; i < half; ++i) {
      double angle = static_cast<double>(positions[static_cast<size_t>(r)]) *
                     std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      c[static_cast<size_t>(r * half + i)] = std::cos(angle);
      s[static_cast<size_t>(r * half + i)] = std::sin(angle);
    }
  return {ops::to(ops::to(from_vector(c, {t, half}), dtype), device),
          ops::to(ops::to(from_vector(s, {t, half}), dtype), device)};
}
}  // namespace

std::pair<Tensor, Tensor> RotaryTables::get(int64_t t, int64_t head_dim, double theta, DType dtype,
                                             Device device) {
  if (!cos_.defined() || cos_.size(0) < t || cos_.dtype() != dtype || cos_.device() != device) {
    std::vector<int64_t> all(static_cast<size_t>(t));
    for (int64_t p = 0; p < t; ++p) all[static_cast<size_t>(p)] = p;
    std::tie(cos_, sin_) = rotary_rows(all, head_dim, theta, dtype, device);
  }
  return {cos_, sin_};
}

std::pair<Tensor, Tensor> RotaryTables::at(const std::vector<int64_t>& positions, int64_t head_dim, double theta,
                                            DType dtype, Device device) {
  if (!cos_at_.defined() || positions_ != positions || cos_at_.dtype() != dtype || cos_at_.device() != device) {
    std::tie(cos_at_, sin_at_) = rotary_rows(positions, head_dim, theta, dtype, device);
    positions_ = positions;
  }
  return {cos_at_, sin_at_};
}

CausalSelfAttention::CausalSelfAttention(const TransformerConfig& cfg, Device device)
    : n_head(cfg.n_head), n_embd(cfg.n_embd), use_rope(cfg.rope), rope_theta(cfg.rope_theta) {
  c_attn = register_module("c_attn", std::make_shared<Linear>(n_embd, 3 * n_embd, cfg.bias, device));
  c_proj = register_module("c_proj", std::make_shared<Linear>(n_embd, n_embd, cfg.bias, device));
  c_proj->init_std = cfg.residual_std();
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(cfg.dropout));
}

namespace {
// [B, T, H*D] -> [B, H, T, D], H from the width: under tensor parallelism a
// rank's projections hold only its own heads.
Tensor split_heads(const Tensor& x, int64_t head_dim) {
  int64_t b = x.size(0), t = x.size(1);
  return transpose(reshape(x, {b, t, x.size(2) / head_dim, head_dim}), 1, 2);
}
// [B, H, T, D] -> [B, T, H*D]
Tensor merge_heads(const Tensor& x) {
  int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  return reshape(transpose(x, 1, 2), {b, t, h * d});
}
// The rotary tables for x [B, T, C]'s tokens: positions 0 .. T-1, or a
// context-parallel rank's global positions.
std::pair<Tensor, Tensor> rotary_tables(RotaryTables& tables, const SequenceShard* sequence, const Tensor& x,
                                        int64_t head_dim, double theta) {
  const DType dt = ops::compute_dtype(x.device(), KernelFamily::Rope, x.dtype());
  if (!sequence) return tables.get(x.size(1), head_dim, theta, dt, x.device());
  const std::vector<int64_t>& positions = sequence->positions();
  TS_CHECK(static_cast<int64_t>(positions.size()) == x.size(1),
           "attention: this rank holds {} tokens of the sequence (context parallelism), but the input has {}",
           positions.size(), x.size(1));
  return tables.at(positions, head_dim, theta, dt, x.device());
}
}  // namespace

Tensor CausalSelfAttention::forward(const Tensor& x) {
  TS_CHECK(x.dim() == 3 && x.size(2) == n_embd, "CausalSelfAttention: expected [B, T, {}], got {}",
           n_embd, shape_str(x.shape()));
  // [q | k | v]; under tensor parallelism this rank's share of each (c_attn split S(0)x3).
  Tensor fused = (*c_attn)(x);
  auto qkv = split(fused, fused.size(2) / 3, 2);
  const int64_t head_dim = n_embd / n_head;
  Tensor q = split_heads(qkv[0], head_dim), k = split_heads(qkv[1], head_dim);
  if (use_rope) {
    auto [cos, sin] = rotary_tables(rotary_, sequence.get(), x, head_dim, rope_theta);
    q = rope(contiguous(q), cos, sin);
    k = rope(contiguous(k), cos, sin);
  }
  Tensor v = split_heads(qkv[2], head_dim);
  Tensor y = sequence ? sequence->attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(head_dim)))
                      : scaled_dot_product_attention(q, k, v, /*causal=*/true);
  return (*resid_dropout)((*c_proj)(merge_heads(y)));
}

LlamaAttention::LlamaAttention(const TransformerConfig& cfg, Device device)
    : n_head(cfg.n_head), n_kv_head(cfg.kv_heads()), head_dim(cfg.head_dim()), rope_theta(cfg.rope_theta) {
  TS_CHECK(head_dim % 2 == 0, "LlamaAttention: rotary embedding needs an even head_dim, got {}",
           head_dim);
  int64_t c = cfg.n_embd;
  q_proj = register_module("q_proj", std::make_shared<Linear>(c, n_head * head_dim, false, device));
  k_proj = register_module("k_proj", std::make_shared<Linear>(c, n_kv_head * head_dim, false, device));
  v_proj = register_module("v_proj", std::make_shared<Linear>(c, n_kv_head * head_dim, false, device));
  o_proj = register_module("o_proj", std::make_shared<Linear>(n_head * head_dim, c, false, device));
  o_proj->init_std = cfg.residual_std();
}

Tensor LlamaAttention::forward(const Tensor& x) {
  TS_CHECK(x.dim() == 3, "LlamaAttention: expected [B, T, C], got {}", shape_str(x.shape()));
  auto [cos, sin] = rotary_tables(rotary_, sequence.get(), x, head_dim, rope_theta);
  Tensor q = rope(contiguous(split_heads((*q_proj)(x), head_dim)), cos, sin);
  Tensor k = rope(contiguous(split_heads((*k_proj)(x), head_dim)), cos, sin);
  Tensor v = split_heads((*v_proj)(x), head_dim);
  Tensor y = sequence ? sequence->attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(head_dim)))
                      : scaled_dot_product_attention(q, k, v, /*causal=*/true);
  return (*o_proj)(merge_heads(y));
}

GPTBlock::GPTBlock(const TransformerConfig& cfg, Device device)
    : checkpoint(cfg.activation_checkpoint), save_matmuls(cfg.ac_save_matmuls) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(cfg.n_embd, cfg.norm_eps, cfg.bias, device));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(cfg, device));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(cfg.n_embd, cfg.norm_eps, cfg.bias, device));
  mlp = register_module("mlp", std::make_shared<GeluMLP>(cfg, device));
}

Tensor GPTBlock::body(const Tensor& x) {
  auto [h, normed] = ln_2->forward_add(x, (*attn)((*ln_1)(x)));
  return h + (*mlp)(normed);
}

Tensor GPTBlock::forward(const Tensor& x) {
  return maybe_checkpoint(checkpoint, save_matmuls, x, [this](const Tensor& in) { return body(in); });
}

LlamaBlock::LlamaBlock(const TransformerConfig& cfg, Device device, int64_t layer)
    : checkpoint(cfg.checkpoints_layer(layer)), save_matmuls(cfg.ac_save_matmuls) {
  input_layernorm = register_module("input_layernorm", std::make_shared<RMSNorm>(cfg.n_embd, cfg.norm_eps, device));
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(cfg, device));
  post_attention_layernorm =
      register_module("post_attention_layernorm", std::make_shared<RMSNorm>(cfg.n_embd, cfg.norm_eps, device));
  if (cfg.is_moe_layer(layer)) moe = register_module("block_sparse_moe", std::make_shared<MoE>(cfg, device));
  else mlp = register_module("mlp", std::make_shared<SwiGLUMLP>(cfg, device));
}

Tensor LlamaBlock::body(const Tensor& x) {
  auto [h, normed] = post_attention_layernorm->forward_add(x, (*self_attn)((*input_layernorm)(x)));
  return h + (moe ? (*moe)(normed) : (*mlp)(normed));
}

Tensor LlamaBlock::forward(const Tensor& x) {
  return maybe_checkpoint(checkpoint, save_matmuls, x, [this](const Tensor& in) { return body(in); });
}

}  // namespace tessera::nn
