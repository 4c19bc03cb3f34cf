// The registry of sharding rules by op id, and the handler runtime/ hands
// every op on DTensors to (runtime/op_call.h).
#include "dtensor/rules.h"

#include <array>
#include <mutex>

namespace tessera::detail {

namespace {

std::array<ShardingRule, kNumOps>& rules() {
  static std::array<ShardingRule, kNumOps> table{};
  return table;
}

// The ops whose rules carry a blocked Shard (S(d)xb) through: it stays on its
// dim, keeps its blocks, and meets only operands blocked alike.
bool takes_blocked(OpId op) {
  switch (op_family(op)) {
    case OpFamily::Pointwise:
    case OpFamily::InPlace:
    case OpFamily::Reduction:
    case OpFamily::Matrix:
    case OpFamily::Random:
    case OpFamily::Like: return true;
    default: return op == OpId::gradient_layout;
  }
}

TensorList handle(OpCall& call) {
  if (!takes_blocked(call.op))
    for (const Tensor& t : call.inputs)
      if (t.defined() && t.is_subclass())
        for (const Placement& p : dtensor_spec(t).placements)
          TS_CHECK(!is_blocked(p), "{}: no sharding rule for a blocked shard ({} in {}); redistribute it to "
                   "Replicate or an unblocked Shard first", call.name, placement_str(p), dtensor_spec(t).str());
  ShardingRule rule = rule_for(call.op);
  return rule != nullptr ? rule(call) : no_rule(call);
}

}  // namespace

void register_rule(OpId op, ShardingRule rule) { rules()[static_cast<size_t>(op)] = rule; }

ShardingRule rule_for(OpId op) { return rules()[static_cast<size_t>(op)]; }

void register_sharding_rules() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_pointwise_rules();
    register_reduction_rules();
    register_matrix_rules();
    register_norm_rules();
    register_attention_rules();
    register_embedding_loss_rules();
    register_random_rules();
    register_view_rules();
    set_op_call_handler(handle);
  });
}

TensorList no_rule(OpCall& call) {
  const Tensor* t = first_dtensor(call.inputs);
  TS_CHECK(false, "{}: no sharding rule for DTensors (got {}); use the local tensor (to_local()) or the whole one "
           "(full_tensor())", call.name, t != nullptr ? t->str() : "no DTensor");
}

// ---- helpers -----------------------------------------------------------------------

const Tensor* first_dtensor(const TensorList& inputs) {
  for (const auto& t : inputs)
    if (t.defined() && t.is_subclass()) return &t;
  return nullptr;
}

bool is_scalar_plain(const Tensor& t) { return t.defined() && !t.is_subclass() && t.dim() == 0; }

Placements without_partial(const Placements& ps) {
  Placements out = ps;
  for (auto& p : out)
    if (is_partial(p)) p = Replicate{};
  return out;
}

bool has_partial(const Placements& ps) {
  for (const auto& p : ps)
    if (is_partial(p)) return true;
  return false;
}

Placement placement_at(const Tensor& t, size_t i) {
  if (!t.defined() || !t.is_subclass()) return Replicate{};
  return dtensor_spec(t).placements[i];
}

TensorList locals_at(const OpCall& call, const DTensorSpec& ref, const Placements& placements) {
  TensorList locals;
  for (const Tensor& t : call.inputs) {
    if (!t.defined() || !t.is_subclass()) {
      TS_CHECK(!t.defined() || t.dim() == 0,
               "{}: mixes a DTensor with a plain tensor of shape {}; make it a DTensor (distribute_tensor / "
               "from_local) or use a scalar",
               call.name, shape_str(t.shape()));
      locals.push_back(t);
      continue;
    }
    const DTensorSpec& s = dtensor_spec(t);
    TS_CHECK(*s.mesh == *ref.mesh, "{}: DTensors on different meshes ({} and {})", call.name, s.mesh->str(),
             ref.mesh->str());
    TS_CHECK(s.global_shape == ref.global_shape || t.dim() == 0,
             "{}: DTensor shapes {} and {} differ (broadcasting between DTensors is not supported)", call.name,
             shape_str(s.global_shape), shape_str(ref.global_shape));
    locals.push_back(local_at(t, placements));
  }
  return locals;
}

Tensor scalar_value(const Tensor& t) {
  return t.is_subclass() ? local_at(t, Placements(dtensor_spec(t).placements.size(), Replicate{})) : t;
}

}  // namespace tessera::detail
