// Ops that run on each shard alone: softmax away from its dim, attention
// over batch and heads, RoPE over the dims before its positions
// (OpAttrs::dims names them). Inputs keep their splits on those dims; any
// other split (a softmax dim, a sequence in attention) is gathered first and
// Partial sums are reduced; then each rank runs the op on its pieces.
#include <algorithm>

#include "dtensor/rules.h"

namespace tessera::detail {

namespace {

// An op independent along call.attrs.dims (softmax away from its dim, attention
// and RoPE over batch and heads): the inputs keep their splits on those dims,
// anything else is gathered first (a split softmax dim, a split sequence in
// attention; Partial sums are reduced), and each rank runs the op on its shards.
TensorList per_shard_rule(OpCall& call) {
  const Tensor* first = nullptr;
  for (const Tensor& t : call.inputs)
    if (first == nullptr && t.defined() && t.is_subclass()) first = &t;
  const DTensorSpec& ref = dtensor_spec(*first);
  const int64_t nd = static_cast<int64_t>(ref.global_shape.size());
  auto is_free = [&](int64_t d) {
    return std::find(call.attrs.dims.begin(), call.attrs.dims.end(), d) != call.attrs.dims.end();
  };
  Placements target = ref.placements;
  for (auto& p : target)
    if (is_partial(p) || (is_shard(p) && !is_free(shard_dim(p) < 0 ? shard_dim(p) + nd : shard_dim(p))))
      p = Replicate{};
  TensorList locals;
  for (const Tensor& t : call.inputs) {
    if (!t.defined() || !t.is_subclass()) {  // plain: the same whole tensor on every rank (RoPE's angles)
      locals.push_back(t);
      continue;
    }
    const DTensorSpec& s = dtensor_spec(t);
    TS_CHECK(*s.mesh == *ref.mesh, "{}: DTensors on different meshes ({} and {})", call.name, s.mesh->str(),
             ref.mesh->str());
    // Inputs of different sizes on a split dim (query heads and fewer key/value
    // heads) stay matched only if every one splits evenly.
    for (size_t i = 0; i < target.size(); ++i) {
      if (!is_shard(target[i])) continue;
      const int64_t d = shard_dim(target[i]), n = ref.mesh->size(static_cast<int64_t>(i));
      TS_CHECK(d < t.dim(), "{}: input {} has {} dims, but the split is on dim {}", call.name, s.str(), t.dim(), d);
      const int64_t a = s.global_shape[static_cast<size_t>(d)], b = ref.global_shape[static_cast<size_t>(d)];
      TS_CHECK(a == b || (a % n == 0 && b % n == 0),
               "{}: inputs {} and {} are split on dim {} over {} ranks, but {} and {} do not both divide evenly, so "
               "their shards would not match (e.g. a rank's query heads and its key/value heads)",
               call.name, ref.str(), s.str(), d, n, b, a);
    }
    locals.push_back(local_at(t, target));
  }
  TensorList out = call.local(locals);
  for (size_t k = 0; k < out.size(); ++k) {
    if (!out[k].defined()) continue;
    const size_t like = k < call.attrs.out_like.size() ? static_cast<size_t>(call.attrs.out_like[k]) : 0;
    const Shape& like_global = dtensor_spec(call.inputs[like]).global_shape;
    Shape global = out[k].shape();
    for (const auto& p : target)
      if (is_shard(p)) global[static_cast<size_t>(shard_dim(p))] = like_global[static_cast<size_t>(shard_dim(p))];
    out[k] = make_dtensor(out[k], ref.mesh, target, global);
  }
  return out;
}

}  // namespace

void register_attention_rules() {
  for (OpId op : {OpId::softmax, OpId::log_softmax, OpId::softmax_backward, OpId::log_softmax_backward,
                  OpId::attention, OpId::attention_backward, OpId::rope})
    register_rule(op, per_shard_rule);
}

}  // namespace tessera::detail
