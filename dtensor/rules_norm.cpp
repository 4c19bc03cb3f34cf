// layer_norm and rms_norm on split rows.
//
// A norm normalises each row (token) over the last dim alone, so an input
// split on any other dim (sequence parallelism's Shard(1) activations, a
// batch's Shard(0)) is normalised on each rank's rows without communication.
// The weight and bias are whole on every rank (Replicate DTensors); their
// gradients sum over the rows, so each rank's is the sum over its own rows:
// Partial over the mesh dims that split the input, reduced once when it
// accumulates into the parameter (the gradient_layout rule, rules_views.cpp).
#include "dtensor/rules.h"

namespace tessera::detail {

namespace {

// The input's layout for a norm (any Partial reduced first), refused when the
// normalised dim is split; the weight and bias checked to be Replicate.
Placements norm_layout(const OpCall& call) {
  const bool backward = call.op == OpId::layer_norm_backward || call.op == OpId::rms_norm_backward;
  // {dy, x, w, mean, rstd}, else {x, w, b}
  const Tensor& x = call.inputs[backward ? 1 : 0];
  TS_CHECK(x.is_subclass(), "{}: the weight is a DTensor but the input is a plain tensor of shape {}; make the "
           "input a DTensor (from_local) or the weight a plain tensor", call.name, shape_str(x.shape()));
  const DTensorSpec& s = dtensor_spec(x);
  const int64_t last = static_cast<int64_t>(s.global_shape.size()) - 1;
  Placements ps = without_partial(s.placements);
  for (size_t i = 0; i < ps.size(); ++i)
    TS_CHECK(!is_shard(ps[i], last), "{}: input {} is split on the normalised (last) dim over mesh dim {}; a norm "
             "needs whole rows (redistribute to Replicate or a Shard of another dim)", call.name, s.str(), i);
  const std::vector<std::pair<size_t, const char*>> params =
      backward ? std::vector<std::pair<size_t, const char*>>{{2, "weight"}}
               : std::vector<std::pair<size_t, const char*>>{{1, "weight"}, {2, "bias"}};
  for (const auto& [j, what] : params) {
    const Tensor& p = call.inputs[j];
    if (!p.defined()) continue;
    TS_CHECK(p.is_subclass(), "{}: the input is {} but the {} is a plain tensor; make it a Replicate DTensor on "
             "the same mesh (tp::SequenceParallel does), so that its gradient is summed over the ranks' rows",
             call.name, s.str(), what);
    const DTensorSpec& sp = dtensor_spec(p);
    TS_CHECK(*sp.mesh == *s.mesh, "{}: the input and the {} are on different meshes ({} and {})", call.name, what,
             s.mesh->str(), sp.mesh->str());
    for (const auto& pl : sp.placements)
      TS_CHECK(is_replicate(pl), "{}: the {} is {}; a norm's weight and bias must be Replicate (whole on every rank)",
               call.name, what, sp.str());
  }
  return ps;
}

Tensor local_or_none(const Tensor& t) { return t.defined() ? dtensor_spec(t).local : Tensor(); }

// Stats (mean, rstd) [rows] are laid out as the input's rows: the same Shards.
Shape rows_of(const Shape& global) { return Shape(global.begin(), global.end() - 1); }

TensorList norm_rule(OpCall& call) {
  const Placements ps = norm_layout(call);
  const DTensorSpec& s = dtensor_spec(call.inputs[0]);
  TensorList out = call.local({local_at(call.inputs[0], ps), local_or_none(call.inputs[1]),
                               local_or_none(call.inputs[2])});
  auto wrap = [&](const Tensor& t, const Shape& shape) {
    return t.defined() ? make_dtensor(t, s.mesh, ps, shape) : Tensor();
  };
  return {wrap(out[0], s.global_shape), wrap(out[1], rows_of(s.global_shape)), wrap(out[2], rows_of(s.global_shape))};
}

TensorList norm_backward_rule(OpCall& call) {
  const Placements ps = norm_layout(call);
  const DTensorSpec& s = dtensor_spec(call.inputs[1]);
  const Tensor& dy = call.inputs[0];
  TS_CHECK(dy.is_subclass(), "{}: the input is {} but its gradient is a plain tensor", call.name, s.str());
  auto stats = [&](const Tensor& t) { return t.defined() ? local_at(t, ps) : Tensor(); };
  TensorList local = call.local({local_at(dy, ps), local_at(call.inputs[1], ps), local_or_none(call.inputs[2]),
                                 stats(call.inputs[3]), stats(call.inputs[4])});
  Placements summed = ps;  // over the rows each rank holds: Partial where they are split
  for (auto& p : summed)
    if (is_shard(p)) p = Partial{dist::ReduceOp::Sum};
  const Shape features{s.global_shape.back()};
  TensorList d(3);
  if (local[0].defined()) d[0] = make_dtensor(local[0], s.mesh, ps, s.global_shape);
  for (size_t i = 1; i < 3; ++i)
    if (local[i].defined()) d[i] = make_dtensor(local[i], s.mesh, summed, features);
  return d;
}

}  // namespace

void register_norm_rules() {
  register_rule(OpId::layer_norm, norm_rule);
  register_rule(OpId::rms_norm, norm_rule);
  register_rule(OpId::layer_norm_backward, norm_backward_rule);
  register_rule(OpId::rms_norm_backward, norm_backward_rule);
}

}  // namespace tessera::detail
