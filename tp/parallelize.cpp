#include "tp/parallelize.h"

#include "dtensor/redistribute.h"

namespace tessera::tp {

namespace {

// The parameter slot's tensor as a DTensor laid out by `placements` over the
// mesh: a meta tensor gets a meta shard of the right shape (bytes come at
// to_empty); a real one is cut from mesh rank 0's values.
Tensor to_dtensor(const Tensor& t, const MeshPtr& mesh, const Placements& placements) {
  TS_CHECK(!t.is_distributed(), "parallelize_module: a parameter is already a DTensor ({}); apply tensor "
           "parallelism before fully_shard, once per module", dtensor_spec(t).str());
  Tensor out;
  if (t.is_meta()) {
    Placements ps = normalize_placements(placements, *mesh, t.dim(), "parallelize_module");
    auto [shape, offset] = local_shape_and_offset(t.shape(), *mesh, ps, mesh->get_coordinate());
    out = make_dtensor(empty(shape, t.dtype(), Device::meta()), mesh, ps, t.shape());
  } else {
    autograd::NoGradGuard no_grad;
    out = distribute_tensor(t, mesh, placements);
  }
  out.set_requires_grad(t.requires_grad());
  return out;
}

void shard_parameter(nn::Module& m, const std::string& name, const MeshPtr& mesh, const Placement& p) {
  nn::Module::Slot* slot = m.find_parameter_slot(name);
  if (slot == nullptr || !slot->value.defined()) return;
  slot->value = to_dtensor(slot->value, mesh, {p});
}

// The input as a DTensor in `desired` placement: a plain tensor is taken to
// be laid out as `layout` (its global shape from `global_last` when the
// layout shards the last dim and a Linear knows its length; else shards are
// taken to be even, as PyTorch's from_local does), then moved.
Tensor prepare_input(const Tensor& x, const MeshPtr& mesh, const Placement& layout, const Placement& desired,
                     std::optional<int64_t> global_last = std::nullopt) {
  Tensor dt = x;
  if (!x.is_distributed()) {
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

nn::Linear& as_linear(nn::Module& m, const std::string& fqn, const char* style) {
  auto* linear = dynamic_cast<nn::Linear*>(&m);
  TS_CHECK(linear != nullptr, "parallelize_module: {} applies to Linear layers, but '{}' is a {}", style, fqn,
           m.type_name());
  return *linear;
}

void check_mesh(const MeshPtr& mesh) {
  TS_CHECK(mesh != nullptr && mesh->ndim() == 1,
           "parallelize_module: expected a 1-D mesh (the tensor-parallel dim; slice a larger mesh by name), got {}",
           mesh ? mesh->str() : std::string("none"));
}

// A Linear split Megatron's way: its weight and bias laid out over the mesh,
// its input moved from the user's layout to the one the split needs, its
// output from the split's to the user's (ColwiseParallel, RowwiseParallel).
class LinearSplit final : public ParallelStyle {
 public:
  struct Layout {
    const char* name;
    Placement weight, bias, input;  // the split's
    Placement input_layout, output_layout;  // the user's
    bool use_local_output;
  };
  explicit LinearSplit(Layout l) : l_(std::move(l)) {}
  std::string name() const override { return l_.name; }
  void apply(nn::Module& m, const MeshPtr& mesh, const std::string& fqn) const override {
    nn::Linear& linear = as_linear(m, fqn, l_.name);
    shard_parameter(m, "weight", mesh, l_.weight);
    shard_parameter(m, "bias", mesh, l_.bias);
    const Layout l = l_;
    const int64_t in = linear.in_features;
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
      if (!y.is_distributed()) y = from_local(y, mesh, {o.output_layout});
      outputs[0] = prepare_output(y, mesh, o.desired_output_layout, o.use_local_output);
    });
  }

 private:
  PrepareModuleOutput o_;
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

}  // namespace

StylePtr style(ColwiseParallel o) {
  return std::make_shared<LinearSplit>(LinearSplit::Layout{"ColwiseParallel", Shard{0}, Shard{0}, Replicate{},
                                                           o.input_layout, o.output_layout, o.use_local_output});
}
StylePtr style(RowwiseParallel o) {
  return std::make_shared<LinearSplit>(LinearSplit::Layout{"RowwiseParallel", Shard{1}, Replicate{}, Shard{-1},
                                                           o.input_layout, o.output_layout, o.use_local_output});
}
StylePtr style(PrepareModuleInput options) { return std::make_shared<PrepareInput>(std::move(options)); }
StylePtr style(PrepareModuleOutput options) { return std::make_shared<PrepareOutput>(std::move(options)); }

void parallelize_module(nn::Module& module, const MeshPtr& mesh, const ParallelizePlan& plan) {
  check_mesh(mesh);
  auto modules = module.named_modules();
  for (const auto& [pattern, s] : plan) {
    TS_CHECK(s != nullptr, "parallelize_module: no style given for '{}'", pattern);
    int found = 0;
    for (const auto& [fqn, m] : modules)
      if (!fqn.empty() && matches(pattern, fqn)) {
        s->apply(*m, mesh, fqn);
        ++found;
      }
    TS_CHECK(found > 0, "parallelize_module: the plan's '{}' ({}) matches no module of this {}", pattern, s->name(),
             module.type_name());
  }
}

ParallelizePlan tensor_parallel_plan(const nn::LanguageModel& model, int64_t degree, bool loss_parallel) {
  const nn::TransformerConfig& c = model.config;
  TS_CHECK(degree >= 1, "tensor parallelism: the degree must be at least 1, got {}", degree);
  TS_CHECK(c.n_head % degree == 0, "tensor parallelism: model.n_head {} is not divisible by the degree {} (each "
           "rank computes whole heads)", c.n_head, degree);
  TS_CHECK(c.kv_heads() % degree == 0, "tensor parallelism: model.n_kv_head {} is not divisible by the degree {} "
           "(each rank needs whole key/value heads for its query heads)", c.kv_heads(), degree);
  const auto col = style(ColwiseParallel{}), row = style(RowwiseParallel{}), once = style(PrepareModuleInput{});
  TS_CHECK(!loss_parallel || !c.tie_embeddings, "tensor parallelism: loss parallelism splits the output layer over "
           "the vocabulary, but model.tie_embeddings ties it to the embedding table, which stays replicated; untie "
           "them or turn loss parallelism off");
  if (dynamic_cast<const nn::Llama*>(&model) != nullptr) {
    ParallelizePlan plan = {{"model.layers.*.self_attn", once},       {"model.layers.*.mlp", once},
                            {"model.layers.*.self_attn.q_proj", col}, {"model.layers.*.self_attn.k_proj", col},
                            {"model.layers.*.self_attn.v_proj", col}, {"model.layers.*.self_attn.o_proj", row},
                            {"model.layers.*.mlp.gate_proj", col},    {"model.layers.*.mlp.up_proj", col},
                            {"model.layers.*.mlp.down_proj", row}};
    if (loss_parallel)  // logits sharded on the vocabulary, for nn::cross_entropy
      plan.push_back({"lm_head", style(ColwiseParallel{.output_layout = Shard{-1}, .use_local_output = false})});
    return plan;
  }
  TS_CHECK(false, "tensor parallelism: no plan for a {} yet (GPT-2's fused c_attn needs each of q, k and v split "
           "separately, a strided shard Tessera does not have); use model.arch llama", model.type_name());
  return {};
}

}  // namespace tessera::tp
