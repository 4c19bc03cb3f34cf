#include "tp/parallelize.h"

#include <algorithm>
#include <map>

#include "dtensor/redistribute.h"

namespace tessera::tp {

namespace {

void shard_parameter(nn::Module& m, const std::string& name, const MeshPtr& mesh, const Placement& p) {
  nn::Module::Slot* slot = m.find_parameter_slot(name);
  if (slot == nullptr || !slot->value.defined()) return;
  slot->value = distribute_parameter(slot->value, mesh, {p}, "parallelize_module");
}

// The input as a DTensor in `desired` placement: a plain tensor is taken to
// be laid out as `layout` (its global shape from `global_last` when the
// layout shards the last dim and a Linear knows its length; else shards are
// taken to be even, as PyTorch's from_local does), then moved.
Tensor prepare_input(const Tensor& x, const MeshPtr& mesh, const Placement& layout, const Placement& desired,
                     std::optional<int64_t> global_last = std::nullopt) {
  Tensor dt = x;
  if (!is_dtensor(x)) {
    std::optional<Shape> global;
    if (global_last && is_shard(layout) && (shard_dim(layout) == -1 || shard_dim(layout) == x.dim() - 1)) {
      Shape s = x.shape();
      s.back() = *global_last;
      global = s;
    }
    dt = from_local(x, mesh, {layout}, global);
  }
  Placements want = normalize_placements({desired}, *mesh, dt.dim(), "parallelize_module");
  return dtensor_spec(dt).placements == want ? dt : redistribute(dt, want);
}

Tensor prepare_output(const Tensor& y, const MeshPtr& mesh, const Placement& layout, bool use_local) {
  Placements want = normalize_placements({layout}, *mesh, y.dim(), "parallelize_module");
  Tensor out = dtensor_spec(y).placements == want ? y : redistribute(y, want);
  return use_local ? to_local(out) : out;
}


void check_mesh(const MeshPtr& mesh) {
  TS_CHECK(mesh != nullptr && mesh->ndim() == 1,
           "parallelize_module: expected a 1-D mesh (the tensor-parallel dim; slice a larger mesh by name), got {}",
           mesh ? mesh->str() : std::string("none"));
}

// A Linear split Megatron's way: its weight and bias laid out over the mesh,
// its input moved from the user's layout to the one the split needs, its
// output from the split's to the user's (ColwiseParallel, RowwiseParallel).
// An Embedding's table is split the other way round (its rows are the
// vocabulary: row-wise is Megatron's vocabulary-parallel embedding, Partial
// out; column-wise splits the features); its indices are used as they come.
class LinearSplit final : public ParallelStyle {
 public:
  struct Layout {
    const char* name;
    Placement weight, bias, input;  // the split's
    Placement table;                // an Embedding's weight
    Placement input_layout, output_layout;  // the user's
    bool use_local_output;
  };
  explicit LinearSplit(Layout l) : l_(std::move(l)) {}
  std::string name() const override { return l_.name; }
  void apply(nn::Module& m, const MeshPtr& mesh, const std::string& fqn) const override {
    const Layout l = l_;
    if (dynamic_cast<nn::Embedding*>(&m) != nullptr) {
      shard_parameter(m, "weight", mesh, l.table);
      m.register_forward_hook([mesh, l](nn::Module&, const TensorList&, TensorList& outputs) {
        outputs[0] = prepare_output(outputs[0], mesh, l.output_layout, l.use_local_output);
      });
      return;
    }
    auto* linear = dynamic_cast<nn::Linear*>(&m);
    TS_CHECK(linear != nullptr, "parallelize_module: {} applies to Linear and Embedding layers, but '{}' is a {}",
             l.name, fqn, m.type_name());
    const int64_t blocks = shard_blocks(l_.weight);
    TS_CHECK(linear->out_features % blocks == 0,
             "parallelize_module: {} splits '{}' as {} fused outputs, but its {} output features are not {} equal "
             "blocks", l.name, fqn, blocks, linear->out_features, blocks);
    shard_parameter(m, "weight", mesh, l_.weight);
    shard_parameter(m, "bias", mesh, l_.bias);
    const int64_t in = linear->in_features;
    m.register_forward_pre_hook([mesh, l, in](nn::Module&, TensorList& inputs) {
      inputs[0] = prepare_input(inputs[0], mesh, l.input_layout, l.input, in);
    });
    m.register_forward_hook([mesh, l](nn::Module&, const TensorList&, TensorList& outputs) {
      outputs[0] = prepare_output(outputs[0], mesh, l.output_layout, l.use_local_output);
    });
  }

 private:
  Layout l_;
};

class PrepareInput final : public ParallelStyle {
 public:
  explicit PrepareInput(PrepareModuleInput o) : o_(std::move(o)) {}
  std::string name() const override { return "PrepareModuleInput"; }
  void apply(nn::Module& m, const MeshPtr& mesh, const std::string&) const override {
    const PrepareModuleInput o = o_;
    m.register_forward_pre_hook([mesh, o](nn::Module&, TensorList& inputs) {
      TS_CHECK(!inputs.empty() && inputs[0].defined(), "PrepareModuleInput: the module was called without an input");
      Tensor x = prepare_input(inputs[0], mesh, o.input_layout, o.desired_input_layout);
      inputs[0] = o.use_local_output ? to_local(x) : x;
    });
  }

 private:
  PrepareModuleInput o_;
};

class PrepareOutput final : public ParallelStyle {
 public:
  explicit PrepareOutput(PrepareModuleOutput o) : o_(std::move(o)) {}
  std::string name() const override { return "PrepareModuleOutput"; }
  void apply(nn::Module& m, const MeshPtr& mesh, const std::string&) const override {
    const PrepareModuleOutput o = o_;
    m.register_forward_hook([mesh, o](nn::Module&, const TensorList&, TensorList& outputs) {
      Tensor y = outputs[0];
      if (!is_dtensor(y)) y = from_local(y, mesh, {o.output_layout});
      outputs[0] = prepare_output(y, mesh, o.desired_output_layout, o.use_local_output);
    });
  }

 private:
  PrepareModuleOutput o_;
};

class SequenceSplit final : public ParallelStyle {
 public:
  explicit SequenceSplit(SequenceParallel o) : o_(o) {}
  std::string name() const override { return "SequenceParallel"; }
  void apply(nn::Module& m, const MeshPtr& mesh, const std::string& fqn) const override {
    TS_CHECK(dynamic_cast<nn::LayerNorm*>(&m) != nullptr || dynamic_cast<nn::RMSNorm*>(&m) != nullptr,
             "parallelize_module: SequenceParallel applies to LayerNorm and RMSNorm, but '{}' is a {}", fqn,
             m.type_name());
    shard_parameter(m, "weight", mesh, Replicate{});
    shard_parameter(m, "bias", mesh, Replicate{});
    const SequenceParallel o = o_;
    m.register_forward_pre_hook([mesh, o](nn::Module&, TensorList& inputs) {
      TS_CHECK(!inputs.empty() && inputs[0].defined(), "SequenceParallel: the module was called without an input");
      if (!is_dtensor(inputs[0])) inputs[0] = from_local(inputs[0], mesh, {Shard{o.sequence_dim}});
    });
    m.register_forward_hook([o](nn::Module&, const TensorList&, TensorList& outputs) {
      if (o.use_local_output && is_dtensor(outputs[0])) outputs[0] = to_local(outputs[0]);
    });
  }

 private:
  SequenceParallel o_;
};

// Whether a dotted path matches a pattern whose "*" components match any one component.
bool matches(const std::string& pattern, const std::string& path) {
  auto split = [](const std::string& s) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t dot; (dot = s.find('.', start)) != std::string::npos; start = dot + 1) parts.push_back(s.substr(start, dot - start));
    parts.push_back(s.substr(start));
    return parts;
  };
  auto p = split(pattern), q = split(path);
  if (p.size() != q.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != "*" && p[i] != q[i]) return false;
  return true;
}

// The output layer's style: column-wise over the vocabulary with loss
// parallelism (logits sharded on the classes, for nn::cross_entropy) or when
// tied to the vocabulary-split embedding (logits gathered); an untied one
// stays replicated, reading every token (null: no style needed).
StylePtr output_layer_style(const nn::TransformerConfig& c, bool loss_parallel, bool sequence_parallel) {
  const Placement between = sequence_parallel ? Placement{Shard{1}} : Placement{Replicate{}};
  if (loss_parallel)
    return style(ColwiseParallel{.input_layout = between, .output_layout = Shard{-1}, .use_local_output = false});
  if (c.tie_embeddings)
    return style(ColwiseParallel{.input_layout = between, .output_layout = Replicate{}});
  if (sequence_parallel)
    return style(PrepareModuleInput{.input_layout = Shard{1}, .desired_input_layout = Replicate{},
                                    .use_local_output = true});
  return nullptr;
}

// GPT-2: c_attn split per block (S(0)x3); the embedding all-reduced, the
// positions added, and the sum split on the sequence at the dropout when
// sequence parallel (the position table stays replicated).
ParallelizePlan gpt_plan(const nn::TransformerConfig& c, const StylePtr& col, const StylePtr& row_out,
                         const StylePtr& once, bool loss_parallel, bool sequence_parallel) {
  ParallelizePlan plan = {{"transformer.h.*.attn", once},
                          {"transformer.h.*.mlp", once},
                          {"transformer.h.*.attn.c_attn", style(ColwiseParallel{.blocks = 3})},
                          {"transformer.h.*.attn.c_proj", row_out},
                          {"transformer.h.*.mlp.c_fc", col},
                          {"transformer.h.*.mlp.c_proj", row_out},
                          {"transformer.wte", style(RowwiseParallel{})}};
  if (sequence_parallel) {
    plan.push_back({"transformer.drop", style(PrepareModuleInput{.input_layout = Replicate{},
                                                                 .desired_input_layout = Shard{1}})});
    const auto norm = style(SequenceParallel{});
    for (const char* path : {"transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"})
      plan.push_back({path, norm});
  }
  if (StylePtr out = output_layer_style(c, loss_parallel, sequence_parallel)) plan.push_back({"lm_head", out});
  return plan;
}

}  // namespace

StylePtr style(ColwiseParallel o) {
  TS_CHECK(o.blocks >= 1, "ColwiseParallel: blocks must be at least 1, got {}", o.blocks);
  const Shard split{0, o.blocks};
  Placement output = o.output_layout;
  if (is_shard(output) && !is_blocked(output) && o.blocks > 1) output = Shard{shard_dim(output), o.blocks};
  return std::make_shared<LinearSplit>(LinearSplit::Layout{"ColwiseParallel", split, split, Replicate{},
                                                           Shard{1, o.blocks}, o.input_layout, output,
                                                           o.use_local_output});
}
StylePtr style(RowwiseParallel o) {
  return std::make_shared<LinearSplit>(LinearSplit::Layout{"RowwiseParallel", Shard{1}, Replicate{}, Shard{-1},
                                                           Shard{0}, o.input_layout, o.output_layout,
                                                           o.use_local_output});
}
StylePtr style(PrepareModuleInput options) { return std::make_shared<PrepareInput>(std::move(options)); }
StylePtr style(PrepareModuleOutput options) { return std::make_shared<PrepareOutput>(std::move(options)); }
StylePtr style(SequenceParallel options) { return std::make_shared<SequenceSplit>(options); }

void parallelize_module(nn::Module& module, const MeshPtr& mesh, const ParallelizePlan& plan) {
  check_mesh(mesh);
  auto modules = module.named_modules();
  // Parameters that several modules share (a tied output layer and
  // embedding table), to be shared again once laid out.
  std::map<const void*, std::vector<std::pair<std::string, nn::Module::Slot*>>> shared;
  for (const auto& [fqn, m] : modules)
    for (auto& slot : m->parameter_slots())
      if (slot.value.defined())
        shared[slot.value.impl_ptr().get()].push_back({fqn.empty() ? slot.name : fqn + "." + slot.name, &slot});
  for (const auto& [pattern, s] : plan) {
    TS_CHECK(s != nullptr, "parallelize_module: no style given for '{}'", pattern);
    int found = 0;
    for (const auto& [fqn, m] : modules)
      if (fqn.empty() ? pattern.empty() : matches(pattern, fqn)) {
        s->apply(*m, mesh, fqn);
        ++found;
      }
    TS_CHECK(found > 0, "parallelize_module: the plan's '{}' ({}) matches no module of this {}", pattern, s->name(),
             module.type_name());
  }
  for (auto& [impl, slots] : shared) {
    if (slots.size() < 2) continue;
    // The first one laid out is the one they all take; another laid out
    // differently, or one left plain beside it, cannot stay tied.
    const auto first = std::find_if(slots.begin(), slots.end(), [&](const auto& e) {
      return e.second->value.impl_ptr().get() != impl;
    });
    if (first == slots.end()) continue;
    const Tensor chosen = first->second->value;
    for (auto& [name, slot] : slots) {
      TS_CHECK(slot->value.impl_ptr().get() != impl,
               "parallelize_module: '{}' and '{}' are one parameter (tied), but the plan lays out the first as {} "
               "and leaves the second as it was; give both modules styles that lay it out alike",
               first->first, name, placements_str(dtensor_spec(chosen).placements));
      TS_CHECK(dtensor_spec(slot->value).placements == dtensor_spec(chosen).placements,
               "parallelize_module: '{}' and '{}' are one parameter (tied), but the plan lays them out as {} and {}",
               first->first, name, placements_str(dtensor_spec(chosen).placements),
               placements_str(dtensor_spec(slot->value).placements));
      slot->value = chosen;
    }
  }
}

namespace {
// Every entry of the model family's plan.
ParallelizePlan full_plan(const nn::LanguageModel& model, int64_t degree, bool loss_parallel,
                          bool sequence_parallel) {
  const nn::TransformerConfig& c = model.config;
  TS_CHECK(degree >= 1, "tensor parallelism: the degree must be at least 1, got {}", degree);
  TS_CHECK(c.n_head % degree == 0, "tensor parallelism: model.n_head {} is not divisible by the degree {} (each "
           "rank computes whole heads)", c.n_head, degree);
  TS_CHECK(c.kv_heads() % degree == 0, "tensor parallelism: model.n_kv_head {} is not divisible by the degree {} "
           "(each rank needs whole key/value heads for its query heads)", c.kv_heads(), degree);
  const bool gpt = dynamic_cast<const nn::GPT*>(&model) != nullptr;
  TS_CHECK(gpt || dynamic_cast<const nn::Llama*>(&model) != nullptr,
           "tensor parallelism: no plan for a {} (GPT and Llama have one)", model.type_name());
  const auto col = style(ColwiseParallel{}), row = style(RowwiseParallel{});
  // Without sequence parallelism the blocks' inputs are whole (Replicate)
  // and each row-wise output is all-reduced; with it they are split on the
  // sequence, all-gathered at each attention and MLP, and each row-wise
  // output is reduce-scattered back to the sequence split.
  const Placement between = sequence_parallel ? Placement{Shard{1}} : Placement{Replicate{}};
  const auto once = style(PrepareModuleInput{.input_layout = between, .desired_input_layout = Replicate{}});
  const auto row_out =
      sequence_parallel ? style(RowwiseParallel{.output_layout = Shard{1}, .use_local_output = false}) : row;
  if (gpt) return gpt_plan(c, col, row_out, once, loss_parallel, sequence_parallel);
  // A mixture of experts (nn/moe.h) runs whole on every rank: the router's
  // choice is made on the host from every token's scores, and each rank's
  // experts (expert parallelism moves tokens between the data-parallel ranks
  // of one tensor-parallel index) compute the same outputs from the same
  // tokens. Its input is gathered whole (Replicate) and handed on as a plain
  // tensor, its output, the same on every rank, handed back in the blocks'
  // layout; its parameters stay plain, their gradients equal on every rank.
  const auto moe_in = style(PrepareModuleInput{.input_layout = between, .desired_input_layout = Replicate{},
                                               .use_local_output = true});
  const auto moe_out = style(PrepareModuleOutput{.output_layout = Replicate{}, .desired_output_layout = between,
                                                 .use_local_output = !sequence_parallel});
  ParallelizePlan plan = {{"model.layers.*.self_attn", once},       {"model.layers.*.mlp", once},
                          {"model.layers.*.block_sparse_moe", moe_in}, {"model.layers.*.block_sparse_moe", moe_out},
                          {"model.layers.*.self_attn.q_proj", col}, {"model.layers.*.self_attn.k_proj", col},
                          {"model.layers.*.self_attn.v_proj", col}, {"model.layers.*.self_attn.o_proj", row_out},
                          {"model.layers.*.mlp.gate_proj", col},    {"model.layers.*.mlp.up_proj", col},
                          {"model.layers.*.mlp.down_proj", row_out}};
  // The embedding table split over the vocabulary (Megatron's
  // VocabParallelEmbedding): each rank looks up its tokens, the others give
  // zero rows, and the Partial sum is all-reduced (reduce-scattered to the
  // sequence split with sequence parallelism).
  plan.push_back({"model.embed_tokens", style(RowwiseParallel{.output_layout = between,
                                                              .use_local_output = !sequence_parallel})});
  if (sequence_parallel) {
    const auto norm = style(SequenceParallel{});
    for (const char* path : {"model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm",
                             "model.norm"})
      plan.push_back({path, norm});
  }
  if (StylePtr out = output_layer_style(c, loss_parallel, sequence_parallel)) plan.push_back({"lm_head", out});
  return plan;
}

// The plan's entries that name a module of `model`: a pipeline stage's part
// lacks the embeddings or the output layer (pp/pipeline.h), and its plan
// leaves them out.
ParallelizePlan present_in(const nn::LanguageModel& model, ParallelizePlan plan) {
  std::vector<std::string> fqns;
  for (const auto& [fqn, m] : const_cast<nn::LanguageModel&>(model).named_modules()) fqns.push_back(fqn);
  std::erase_if(plan, [&](const auto& entry) {
    return std::none_of(fqns.begin(), fqns.end(), [&](const std::string& f) { return matches(entry.first, f); });
  });
  return plan;
}
}  // namespace

ParallelizePlan tensor_parallel_plan(const nn::LanguageModel& model, int64_t degree, bool loss_parallel,
                                     bool sequence_parallel) {
  return present_in(model, full_plan(model, degree, loss_parallel, sequence_parallel));
}

}  // namespace tessera::tp
