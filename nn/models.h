// Two language models with the parameter names of their reference
// implementations, so checkpoints interoperate:
//   GPT   - nanoGPT / GPT-2: transformer.wte.weight, transformer.wpe.weight,
//           transformer.h.0.attn.c_attn.weight, ..., transformer.ln_f.weight, lm_head.weight
//   Llama - Hugging Face Llama: model.embed_tokens.weight,
//           model.layers.0.self_attn.q_proj.weight, ..., model.norm.weight, lm_head.weight
#pragma once

#include "nn/transformer.h"

namespace tessera::nn {

// Shared model interface: token ids [B, T] (i64) -> logits [B, T, vocab].
class LanguageModel : public Module {
 public:
  explicit LanguageModel(TransformerConfig cfg) : config(cfg) {}
  const TransformerConfig config;
  // The transformer blocks, in order (fully_shard them one by one).
  std::vector<std::shared_ptr<Module>> blocks;
  // Parameters in the 6N FLOPs-per-token estimate (embeddings of positions excluded).
  int64_t num_parameters(bool exclude_position_embedding = true) const;

  // The three parts forward() chains, for a pipeline stage that holds some
  // of them: token ids -> the first block's input; the blocks; the last
  // block's output -> logits. forward(idx) == head(run_blocks(embed(idx)));
  // a part without embeddings takes hidden states, one without the output
  // layer returns them.
  virtual Tensor embed(const Tensor& idx) = 0;
  Tensor run_blocks(Tensor x);
  virtual Tensor head(const Tensor& x) = 0;

  // Context parallelism (cp/): every block's attention and the positions of
  // the embedding see this rank's slice of the sequence through `shard`
  // (null: whole sequences again).
  void set_sequence_shard(std::shared_ptr<SequenceShard> shard);
  const std::shared_ptr<SequenceShard>& sequence_shard() const { return sequence_shard_; }

  // The mean cross-entropy of the model on idx -> targets, through the
  // module's call (its hooks, FSDP's among them, run). With the chunked loss
  // on (the default) the output layer and the loss run in chunks of rows
  // (linear_cross_entropy): the [tokens, vocabulary] logits are never whole.
  // A tensor-parallel output layer (DTensor weight: loss parallelism) runs
  // on chunks of positions under activation checkpointing instead, so that
  // one chunk's logits shard exists at a time there too.
  Tensor loss(const Tensor& idx, const Tensor& targets);
  // Rows per chunk of the output layer and loss: > 0 that many, 0 (default)
  // as many as keep one chunk's logits within 256 MiB, and chunks only where
  // the logits are larger than that (one chunk would save nothing), < 0 off
  // (the logits whole, then cross_entropy).
  void set_loss_chunk_rows(int64_t rows) { loss_chunk_rows_ = rows; }
  int64_t loss_chunk_rows() const { return loss_chunk_rows_; }
  // The rows per chunk for n rows (what 0 means for this vocabulary and dtype).
  int64_t chunk_rows_for(int64_t n) const;

 protected:
  void check_tokens(const Tensor& idx) const;
  // The output layer on the last block's output: logits, or while loss()
  // runs, the loss against its targets.
  Tensor output(const Tensor& normed, const std::shared_ptr<Linear>& lm_head);
  Tensor output_loss_in_chunks(const Tensor& normed, const std::shared_ptr<Linear>& lm_head, const Tensor& targets);
  std::shared_ptr<SequenceShard> sequence_shard_;
  int64_t loss_chunk_rows_ = 0;
  Tensor loss_targets_;  // set while loss() runs
};

class GPT : public LanguageModel {
 public:
  // Builds on `device`; on a real device the weights are initialised from cfg seed 0
  // (call init_weights(seed) for another seed). config.arch is set to "gpt2"
  // (Llama's to "llama") whatever cfg.arch says.
  GPT(const TransformerConfig& cfg, Device device = Device::cpu());
  static std::shared_ptr<GPT> on_meta(const TransformerConfig& cfg) {
    return std::make_shared<GPT>(cfg, Device::meta());
  }
  Tensor forward(const Tensor& idx) override;
  Tensor embed(const Tensor& idx) override;
  Tensor head(const Tensor& x) override;
  void reset_parameters(uint64_t seed, const std::string& prefix) override;
  std::string type_name() const override { return "GPT"; }

  std::shared_ptr<ModuleDict> transformer;
  std::shared_ptr<Embedding> wte, wpe;  // wpe null with config.rope
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList> h;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Linear> lm_head;
};

class Llama : public LanguageModel {
 public:
  Llama(const TransformerConfig& cfg, Device device = Device::cpu());
  static std::shared_ptr<Llama> on_meta(const TransformerConfig& cfg) {
    return std::make_shared<Llama>(cfg, Device::meta());
  }
  Tensor forward(const Tensor& idx) override;
  Tensor embed(const Tensor& idx) override;
  Tensor head(const Tensor& x) override;
  std::string type_name() const override { return "LlamaForCausalLM"; }

  std::shared_ptr<ModuleDict> model;
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> lm_head;
};

// For its scope, the models run on whole sequences (context parallelism set
// aside: generation, evaluation on every rank); their sequence shards come
// back when it ends.
class WholeSequences {
 public:
  explicit WholeSequences(std::vector<LanguageModel*> models);
  ~WholeSequences() noexcept;
  WholeSequences(const WholeSequences&) = delete;
  WholeSequences& operator=(const WholeSequences&) = delete;

 private:
  std::vector<std::pair<LanguageModel*, std::shared_ptr<SequenceShard>>> saved_;
};

// The model cfg.arch names (gpt2: GPT, llama: Llama), built on `device`
// (meta: no bytes until to_empty); cfg is validated first.
std::shared_ptr<LanguageModel> make_model(const TransformerConfig& cfg, Device device = Device::cpu());

// Mean cross-entropy of logits [..., V] against targets [...] (i64). Logits
// that are a DTensor with the classes split over a mesh dim (a loss-parallel
// output layer's) are never gathered (dtensor/ops.cpp); the loss is then this
// rank's copy of the replicated value.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);
// Mean squared error between input and target of the same shape and dtype.
Tensor mse_loss(const Tensor& input, const Tensor& target);

}  // namespace tessera::nn
