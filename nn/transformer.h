// Transformer building blocks shared by the GPT-2 and Llama models.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "runtime/checked.h"

namespace tessera::nn {

struct TransformerConfig {
  std::string arch = "gpt2";  // gpt2 | llama: the model make_model builds (nn/models.h)
  int64_t vocab_size = 256;
  int64_t block_size = 128;  // maximum sequence length
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_kv_head = 0;  // 0: same as n_head (Llama: grouped-query attention when fewer)
  int64_t n_embd = 256;
  int64_t ffn_hidden = 0;  // 0: 4 * n_embd (GPT-2) or Llama's 2/3 * 4 * n_embd rounded to 64
  double dropout = 0.0;
  bool bias = true;             // GPT-2 Linear/LayerNorm biases
  bool tie_embeddings = true;   // lm_head.weight is the token embedding
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // Llama, and GPT with rope
  bool rope = false;  // GPT-2: rotary q/k instead of learned positions (no transformer.wpe); Llama always
  bool gelu_tanh = false;  // GPT-2's MLP: GELU's tanh approximation (GPT-2, Hugging Face) instead of exact (nanoGPT)
  bool activation_checkpoint = false;  // recompute each block in backward
  // Selective activation checkpointing (TorchTitan's two options), with
  // activation_checkpoint on: only every k-th block (blocks 0, k, 2k, ...;
  // 1: every block) is checkpointed; and/or in a checkpointed block the
  // matrix products' and attention's outputs are kept, only the pointwise
  // ops and norms recomputed (autograd::CheckpointPolicy::save_matmuls).
  int64_t ac_layer_frequency = 1;
  bool ac_save_matmuls = false;
  // Whether block `layer` is checkpointed.
  bool checkpoints_layer(int64_t layer) const {
    return activation_checkpoint && layer % std::max<int64_t>(ac_layer_frequency, 1) == 0;
  }

  // Mixture of experts (Llama; nn/moe.h). 0 experts: every MLP is dense.
  int64_t moe_experts = 0;
  int64_t moe_top_k = 2;           // experts per token
  int64_t moe_shared_experts = 0;  // experts every token passes through (DeepSeek, Qwen-MoE)
  int64_t moe_every = 1;           // layer i is MoE when (i + 1) % moe_every == 0 (1: all, Mixtral)
  int64_t moe_hidden = 0;          // each expert's width (0: mlp_hidden())
  std::string moe_router = "softmax";  // softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
  bool moe_norm_topk = true;  // softmax: the chosen weights rescaled to sum to 1 (Mixtral; sigmoid always)
  std::string moe_balance = "aux_loss";  // none | aux_loss | bias (DeepSeek-V3's loss-free balancing)
  double moe_balance_coeff = 0;  // 0: the method's default (aux_loss 0.01, bias 0.001)

  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t head_dim() const { return n_embd / n_head; }
  // The width of the MLP: ffn_hidden, else 4 * n_embd (GPT-2) or Llama's
  // 8/3 * n_embd rounded up to a multiple of 64.
  int64_t mlp_hidden() const;
  bool is_moe() const { return moe_experts > 0; }
  bool is_moe_layer(int64_t layer) const { return is_moe() && (layer + 1) % moe_every == 0; }
  int64_t moe_layer_count() const { return is_moe() ? n_layer / moe_every : 0; }
  // GPT-2's init std of the projections into the residual stream: 0.02 / sqrt(2 n_layer).
  double residual_std() const;
  int64_t moe_width() const { return moe_hidden > 0 ? moe_hidden : mlp_hidden(); }
  double moe_balance_coefficient() const {
    return moe_balance_coeff > 0 ? moe_balance_coeff : moe_balance == "bias" ? 0.001 : 0.01;
  }

  // What a caller calls a field in its messages: tessera-train maps
  // "n_embd" to "model.n_embd" and "block_size" to "training.seq_len".
  // Empty: the fields' own names.
  using FieldNames = tessera::FieldNames;
  // Every field against its range and the others, for arch; throws naming
  // the field, the value found and what is allowed (every model a Tessera
  // program builds, trains, imports or exports is checked here).
  void validate(const FieldNames& names = {}) const;
  // The parameter count from the configuration alone, nothing built; every
  // product and sum is checked, and an overflow throws naming the fields.
  // Tied weights count once; GPT-2's position table counts (nanoGPT's
  // summary line leaves it out: LanguageModel::num_parameters).
  int64_t parameter_count(const FieldNames& names = {}) const;
  // The parameters one token's forward multiplies by: parameter_count less
  // the routed experts a token does not pick (moe_experts - moe_top_k per MoE
  // layer). The N of the 6N FLOPs per token of an MoE model.
  int64_t active_parameter_count() const;
  // What a file may claim beyond validate(): at most kMaxLayers layers, so
  // that building the model it describes (on meta, before any weight is
  // read) is bounded work. The importers call it (io/hf.h, io/llmc.h, a
  // checkpoint's stored model).
  static constexpr int64_t kMaxLayers = 10000;
  void check_file_claims(const FieldNames& names = {}) const;
};

// This rank's slice of every sequence, under context parallelism (cp/): the
// global positions of its tokens, and causal attention of its queries against
// the whole sequence's keys (the slice's owner exchanges K/V with the other
// slices' ranks). A model without one sees whole sequences: positions
// 0 .. T-1 and scaled_dot_product_attention.
class SequenceShard {
 public:
  virtual ~SequenceShard() = default;
  // The global position of each of this rank's tokens, in the order they are
  // held (for rotary tables and learned positions); its size is the local length.
  virtual const std::vector<int64_t>& positions() const = 0;
  // Causal attention over the whole sequence of this rank's queries q
  // [B, H, T_local, D] with its keys and values k, v [B, Hkv, T_local, D].
  virtual Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale) = 0;
  // A batch of whole sequences (tokens, targets) [B, T], the same on every
  // rank holding a slice: this rank's slices (and the layout for T).
  virtual std::pair<Tensor, Tensor> shard_batch(const Tensor& tokens, const Tensor& targets,
                                                int64_t ignore_index = -100) = 0;
  // The slice's mean loss weighed so that the mean over the slices' ranks is
  // the whole sequence's mean (train::forward_backward calls both).
  virtual Tensor weigh_loss(const Tensor& mean_loss) const = 0;
};

// GPT-2 MLP: c_fc -> GELU -> c_proj.
class GeluMLP : public Module {
 public:
  GeluMLP(const TransformerConfig& cfg, Device device);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "MLP"; }
  std::shared_ptr<Linear> c_fc, c_proj;
  std::shared_ptr<Dropout> dropout;
  bool tanh_approximation = false;
};

// Llama MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), the gate fused
// (swiglu: one output instead of silu's and the product's).
class SwiGLUMLP : public Module {
 public:
  SwiGLUMLP(const TransformerConfig& cfg, Device device);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LlamaMLP"; }
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

// Rotary embedding tables: cos/sin [T, head_dim/2] of pos * theta^(-2i/head_dim),
// computed in f64 and cached per length, dtype and device.
class RotaryTables {
 public:
  // The tables for sequences of length t (a prefix of the cached ones).
  std::pair<Tensor, Tensor> get(int64_t t, int64_t head_dim, double theta, DType dtype, Device device);
  // The tables' rows at the given positions (a context-parallel rank's tokens),
  // each row the same numbers as row p of get's.
  std::pair<Tensor, Tensor> at(const std::vector<int64_t>& positions, int64_t head_dim, double theta, DType dtype,
                               Device device);

 private:
  Tensor cos_, sin_;
  std::vector<int64_t> positions_;  // at's cache: the positions cos_at_/sin_at_ hold
  Tensor cos_at_, sin_at_;
};

// GPT-2 attention: one fused c_attn projection to q, k, v; causal SDPA; c_proj.
// With cfg.rope, q and k are rotated as in Llama (Hugging Face's rotate-half).
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const TransformerConfig& cfg, Device device);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "CausalSelfAttention"; }
  int64_t n_head, n_embd;
  bool use_rope;
  double rope_theta;
  std::shared_ptr<Linear> c_attn, c_proj;
  std::shared_ptr<Dropout> resid_dropout;
  std::shared_ptr<SequenceShard> sequence;  // context parallelism: LanguageModel::set_sequence_shard

 private:
  RotaryTables rotary_;
};

// Llama attention: q/k/v/o projections, rotary embedding, grouped-query attention.
class LlamaAttention : public Module {
 public:
  LlamaAttention(const TransformerConfig& cfg, Device device);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LlamaAttention"; }
  int64_t n_head, n_kv_head, head_dim;
  double rope_theta;
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<SequenceShard> sequence;  // context parallelism: LanguageModel::set_sequence_shard

 private:
  RotaryTables rotary_;
};

// h = x + attn(ln_1(x)), then h + mlp(ln_2(h)); h and ln_2(h) made in one
// pass (LayerNorm::forward_add).
class GPTBlock : public Module {
 public:
  GPTBlock(const TransformerConfig& cfg, Device device);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Block"; }
  bool checkpoint;            // recompute this block in backward (TransformerConfig::checkpoints_layer)
  bool save_matmuls = false;  // and keep its products' outputs (selective, per op)
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<GeluMLP> mlp;

 private:
  Tensor body(const Tensor& x);
};

class MoE;

class LlamaBlock : public Module {
 public:
  // Layer `layer` of the model: its MLP is a mixture of experts when
  // cfg.is_moe_layer(layer), registered as block_sparse_moe (Mixtral's name).
  LlamaBlock(const TransformerConfig& cfg, Device device, int64_t layer = 0);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LlamaDecoderLayer"; }
  bool checkpoint;            // recompute this block in backward (TransformerConfig::checkpoints_layer)
  bool save_matmuls = false;  // and keep its products' outputs (selective, per op)
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<SwiGLUMLP> mlp;  // null in an MoE layer
  std::shared_ptr<MoE> moe;        // null in a dense layer

 private:
  Tensor body(const Tensor& x);
};

// Runs f(x) under activation checkpointing when `on` (and grad mode is on).
Tensor maybe_checkpoint(bool on, bool save_matmuls, const Tensor& x, const std::function<Tensor(const Tensor&)>& f);

}  // namespace tessera::nn
