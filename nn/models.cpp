#include "nn/models.h"

#include <algorithm>

#include "dtensor/dtensor.h"

namespace tessera::nn {

int64_t LanguageModel::num_parameters(bool exclude_position_embedding) const {
  int64_t n = 0;
  for (auto& [name, p] : named_parameters()) {
    if (exclude_position_embedding && name == "transformer.wpe.weight") continue;
    n += p.numel();
  }
  return n;
}

void LanguageModel::check_tokens(const Tensor& idx) const {
  TS_CHECK(idx.dim() == 2, "{}: expected token ids [batch, seq], got {}", type_name(),
           shape_str(idx.shape()));
  TS_CHECK(idx.dtype() == DType::I64 || idx.dtype() == DType::I32,
           "{}: token ids must be i64 or i32, got {}", type_name(), dtype_name(idx.dtype()));
  TS_CHECK(idx.size(1) <= config.block_size,
           "{}: sequence length {} exceeds the model's block_size {}", type_name(), idx.size(1),
           config.block_size);
}

void LanguageModel::set_sequence_shard(std::shared_ptr<SequenceShard> shard) {
  sequence_shard_ = shard;
  for (auto& block : blocks) {
    if (auto* gpt = dynamic_cast<GPTBlock*>(block.get())) gpt->attn->sequence = shard;
    else if (auto* llama = dynamic_cast<LlamaBlock*>(block.get())) llama->self_attn->sequence = shard;
    else TS_CHECK(false, "{}::set_sequence_shard: block {} is a {}, not a GPT-2 or Llama block", type_name(),
                  &block - blocks.data(), block->type_name());
  }
}

WholeSequences::WholeSequences(std::vector<LanguageModel*> models) {
  for (LanguageModel* m : models) {
    saved_.emplace_back(m, m->sequence_shard());
    if (m->sequence_shard()) m->set_sequence_shard(nullptr);
  }
}

WholeSequences::~WholeSequences() noexcept {
  // set_sequence_shard throws only for a block that is neither GPT-2's nor
  // Llama's, and these blocks took the shard before.
  for (auto& [m, shard] : saved_)
    if (shard) m->set_sequence_shard(shard);
}

namespace {
TransformerConfig with_arch(TransformerConfig cfg, const char* arch) {
  cfg.arch = arch;
  return cfg;
}
}  // namespace

std::shared_ptr<LanguageModel> make_model(const TransformerConfig& cfg, Device device) {
  cfg.validate();
  if (cfg.arch == "llama") return std::make_shared<Llama>(cfg, device);
  return std::make_shared<GPT>(cfg, device);
}

GPT::GPT(const TransformerConfig& config_in, Device device) : LanguageModel(with_arch(config_in, "gpt2")) {
  const TransformerConfig& cfg = config;
  cfg.validate();
  // Built on meta, then materialised: each weight is initialised once, by FQN.
  Device build = Device::meta();
  transformer = register_module("transformer", std::make_shared<ModuleDict>());
  wte = transformer->register_module("wte", std::make_shared<Embedding>(cfg.vocab_size, cfg.n_embd, build));
  if (!cfg.rope)  // with rotary q/k there are no learned positions
    wpe = transformer->register_module("wpe", std::make_shared<Embedding>(cfg.block_size, cfg.n_embd, build));
  drop = transformer->register_module("drop", std::make_shared<Dropout>(cfg.dropout));
  h = transformer->register_module("h", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    auto block = std::make_shared<GPTBlock>(cfg, build);
    block->checkpoint = cfg.checkpoints_layer(i);
    h->push_back(block);
    blocks.push_back(block);
  }
  ln_f = transformer->register_module("ln_f", std::make_shared<LayerNorm>(cfg.n_embd, cfg.norm_eps, cfg.bias, build));
  lm_head = register_module("lm_head", std::make_shared<Linear>(cfg.n_embd, cfg.vocab_size, false, build));
  if (cfg.tie_embeddings) lm_head->weight = wte->weight;  // one tensor in two slots
  if (!device.is_meta()) {
    to_empty(device);
    init_weights(0);
  }
}

void GPT::reset_parameters(uint64_t, const std::string&) {}

Tensor LanguageModel::run_blocks(Tensor x) {
  for (auto& block : blocks) x = (*block)(x);
  return x;
}

// A pipeline stage's part (pp/pipeline.h) may lack the embeddings (its input
// is then the previous stage's output) or the output layer (it returns its
// last block's output).
Tensor GPT::forward(const Tensor& idx) {
  Tensor h = run_blocks(wte ? embed(idx) : idx);
  return lm_head ? head(h) : h;
}

Tensor GPT::embed(const Tensor& idx) {
  TS_CHECK(wte != nullptr, "GPT::embed: this model part has no token embedding (a later pipeline stage's)");
  check_tokens(idx);
  Tensor x = (*wte)(idx);
  if (wpe) {
    // Context parallelism: this rank's tokens sit at their global positions.
    Tensor positions;
    if (sequence_shard_) {
      const std::vector<int64_t>& p = sequence_shard_->positions();
      TS_CHECK(static_cast<int64_t>(p.size()) == idx.size(1),
               "GPT::embed: this rank holds {} tokens of the sequence (context parallelism), but the input has {}",
               p.size(), idx.size(1));
      positions = ops::to(ops::to(from_vector(p, {idx.size(1)}), idx.dtype()), idx.device());
    } else {
      positions = arange(0, idx.size(1), 1, idx.dtype(), idx.device());
    }
    x = x + (*wpe)(positions);
  }
  return (*drop)(x);
}

Tensor GPT::head(const Tensor& x) {
  TS_CHECK(lm_head != nullptr, "GPT::head: this model part has no output layer (an earlier pipeline stage's)");
  return output((*ln_f)(x), lm_head);
}

Llama::Llama(const TransformerConfig& config_in, Device device) : LanguageModel(with_arch(config_in, "llama")) {
  const TransformerConfig& cfg = config;
  cfg.validate();
  Device build = Device::meta();
  model = register_module("model", std::make_shared<ModuleDict>());
  embed_tokens = model->register_module("embed_tokens", std::make_shared<Embedding>(cfg.vocab_size, cfg.n_embd, build));
  layers = model->register_module("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    auto block = std::make_shared<LlamaBlock>(cfg, build, i);
    layers->push_back(block);
    blocks.push_back(block);
  }
  norm = model->register_module("norm", std::make_shared<RMSNorm>(cfg.n_embd, cfg.norm_eps, build));
  lm_head = register_module("lm_head", std::make_shared<Linear>(cfg.n_embd, cfg.vocab_size, false, build));
  if (cfg.tie_embeddings) lm_head->weight = embed_tokens->weight;
  if (!device.is_meta()) {
    to_empty(device);
    init_weights(0);
  }
}

Tensor Llama::forward(const Tensor& idx) {
  Tensor h = run_blocks(embed_tokens ? embed(idx) : idx);
  return lm_head ? head(h) : h;
}

Tensor Llama::embed(const Tensor& idx) {
  TS_CHECK(embed_tokens != nullptr,
           "Llama::embed: this model part has no token embedding (a later pipeline stage's)");
  check_tokens(idx);
  return (*embed_tokens)(idx);
}

Tensor Llama::head(const Tensor& x) {
  TS_CHECK(lm_head != nullptr, "Llama::head: this model part has no output layer (an earlier pipeline stage's)");
  return output((*norm)(x), lm_head);
}

int64_t LanguageModel::chunk_rows_for(int64_t n) const {
  if (loss_chunk_rows_ > 0) return std::min(loss_chunk_rows_, std::max<int64_t>(n, 1));
  constexpr int64_t kChunkBytes = int64_t{256} << 20;
  const int64_t row_bytes = std::max<int64_t>(config.vocab_size, 1) * 4;  // f32 logits (the widest but f64)
  return std::clamp<int64_t>(kChunkBytes / row_bytes, 1, std::max<int64_t>(n, 1));
}

Tensor LanguageModel::output(const Tensor& normed, const std::shared_ptr<Linear>& lm_head) {
  if (!loss_targets_.defined()) return (*lm_head)(normed);
  Tensor targets = loss_targets_;
  if (is_dtensor(normed) || is_dtensor(lm_head->weight) || lm_head->bias.defined())
    return output_loss_in_chunks(normed, lm_head, targets);
  return linear_cross_entropy(normed, lm_head->weight, targets, chunk_rows_for(leading_numel(normed.shape())));
}

// A tensor-parallel output layer (loss parallelism: its weight split over the
// vocabulary, and with sequence parallelism its input over the positions):
// the layer and the vocabulary-parallel loss run on chunks of the hidden
// states, each under activation checkpointing, so that one chunk's logits
// (this rank's columns of them) exist at a time, in the forward and again
// in the backward's recomputation. Chunks are slices of positions (of whole
// sequences where the positions are split); each chunk's mean is weighed by
// its share of the counted targets, which gives the whole batch's mean.
Tensor LanguageModel::output_loss_in_chunks(const Tensor& normed, const std::shared_ptr<Linear>& lm_head,
                                           const Tensor& targets) {
  auto whole = [&] { return nn::cross_entropy((*lm_head)(normed), targets); };
  const Shape& s = normed.shape();
  if (normed.dim() != 3 || is_dtensor(targets) || targets.shape() != Shape{s[0], s[1]}) return whole();
  // A dim a DTensor splits (or holds pending sums of) cannot be sliced locally.
  auto split = [&](int64_t d) {
    if (!is_dtensor(normed)) return false;
    for (const Placement& p : dtensor_spec(normed).placements)
      if (is_partial(p) || (is_shard(p) && shard_dim(p) == d)) return true;
    return false;
  };
  const int64_t chunk = chunk_rows_for(s[0] * s[1]);
  int64_t dim = -1, len = 0;
  if (!split(1)) dim = 1, len = std::max<int64_t>(1, chunk / s[0]);
  else if (!split(0)) dim = 0, len = std::max<int64_t>(1, chunk / s[1]);
  if (dim < 0 || len >= s[static_cast<size_t>(dim)]) return whole();

  auto slice = [&](int64_t at, int64_t n) {
    if (!is_dtensor(normed)) return narrow(normed, dim, at, n);
    const DTensorSpec& spec = dtensor_spec(normed);
    Shape global = s;
    global[static_cast<size_t>(dim)] = n;
    return from_local(narrow(to_local(normed), dim, at, n), spec.mesh, spec.placements, global);
  };
  auto counted = [](const Tensor& t) {
    return ops::sum(ops::binary(ops::BinaryOp::Ne, t, -100.0), {}, false, DType::F64);
  };
  const Tensor total = ops::binary(ops::BinaryOp::Maximum, counted(targets), 1.0);
  Tensor loss;
  DType dtype = normed.dtype();  // the loss's, as the whole layer's would be
  for (int64_t at = 0; at < s[static_cast<size_t>(dim)]; at += len) {
    const int64_t n = std::min(len, s[static_cast<size_t>(dim)] - at);
    Tensor t = ops::contiguous(ops::narrow(targets, dim, at, n));
    auto segment = [lm_head, t](const TensorList& in) -> TensorList {
      return {nn::cross_entropy((*lm_head)(in[0]), t)};
    };
    Tensor part = autograd::checkpoint(segment, {slice(at, n)})[0];
    dtype = part.dtype();
    const DType acc = part.dtype() == DType::F64 ? DType::F64 : DType::F32;
    Tensor share = ops::to(ops::div(counted(t), total), acc);  // a constant: no gradient
    Tensor weighed = mul(tessera::to(part, acc), share);
    loss = loss.defined() ? add(loss, weighed) : weighed;
  }
  return loss.dtype() == dtype ? loss : tessera::to(loss, dtype);
}

Tensor LanguageModel::loss(const Tensor& idx, const Tensor& targets) {
  // By default chunks only where the logits would exceed one chunk's
  // budget: one chunk of everything saves nothing and costs a little.
  const int64_t n = idx.numel();
  if (loss_chunk_rows_ < 0 || (loss_chunk_rows_ == 0 && chunk_rows_for(n) >= n))
    return nn::cross_entropy((*this)(idx), targets);
  // forward() returns the loss while the targets are set; cleared on any exit.
  struct Clear {
    Tensor& t;
    ~Clear() { t = Tensor(); }
  } clear{loss_targets_};
  loss_targets_ = targets;
  Tensor out = (*this)(idx);
  TS_CHECK(out.dim() == 0 || out.numel() == 1,
           "LanguageModel::loss: this model part has no output layer (an earlier pipeline stage's)");
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  TS_CHECK(logits.dim() >= 1, "cross_entropy: logits need a class dim, got {}", shape_str(logits.shape()));
  Shape expect(logits.shape().begin(), logits.shape().end() - 1);
  TS_CHECK(targets.shape() == expect, "cross_entropy: targets {} do not match logits {} (expected {})",
           shape_str(targets.shape()), shape_str(logits.shape()), shape_str(expect));
  const int64_t v = logits.size(-1), rows = leading_numel(logits.shape());
  Tensor flat_targets = ops::reshape(targets, {targets.numel()});
  if (is_dtensor(logits)) {
    // Loss parallelism (dtensor/ops.cpp): logits whose classes are split over
    // a mesh dim, e.g. a column-wise output layer's. The leading dims are
    // flattened on each rank's block (the classes, the last dim, stay split);
    // the loss comes back as this rank's value of the Replicate result.
    const DTensorSpec& s = dtensor_spec(logits);
    Placements summed = s.placements, flat = s.placements;
    for (size_t i = 0; i < flat.size(); ++i) {
      Placement& p = flat[i];
      TS_CHECK(!is_shard(p) || shard_dim(p) == logits.dim() - 1,
               "cross_entropy: logits {} are split on a dim other than the classes (the last); supported: the "
               "classes split over one mesh dim, Replicate on the others", s.str());
      if (is_partial(p)) p = summed[i] = Replicate{};  // pending sums are reduced first (differentiably)
      if (is_shard(p)) p = moved_to(p, 1);  // (a blocked split stays blocked, and is refused by the rule)
    }
    Tensor whole = summed == s.placements ? logits : redistribute(logits, summed);
    Tensor local = to_local(whole);
    Tensor block = from_local(reshape(local, {rows, local.size(-1)}), s.mesh, flat, Shape{rows, v});
    return to_local(tessera::cross_entropy(block, flat_targets, ignore_index));
  }
  return tessera::cross_entropy(reshape(logits, {rows, v}), flat_targets, ignore_index);
}

Tensor mse_loss(const Tensor& input, const Tensor& target) {
  TS_CHECK(input.shape() == target.shape(), "mse_loss: target {} does not match input {}",
           shape_str(target.shape()), shape_str(input.shape()));
  TS_CHECK(input.dtype() == target.dtype(), "mse_loss: target is {} but input is {}", dtype_name(target.dtype()),
           dtype_name(input.dtype()));
  return mean(square(input - target));
}

}  // namespace tessera::nn
