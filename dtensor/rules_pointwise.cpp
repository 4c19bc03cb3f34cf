// Pointwise ops, in-place updates and copies laid out as their input.
//
//   elementwise   same placements in, same out (other DTensors are
//                 redistributed to the first one's); a Partial input is reduced
//                 first, except for ops linear in it (add/sub of Partials,
//                 negation, scaling by a scalar: OpAttrs::linear)
//   in-place      every DTensor operand must share the target's spec; runs on
//                 the local shards with no communication
//   bias_gelu     gelu(x + bias) and its backward: x as it is laid out (a
//                 Partial x reduced first: GELU is not linear), the bias as
//                 x's last dim (Shard(0) where x is split there: a column-wise
//                 c_fc); the bias gradient Partial where x's rows are split
//   like          contiguous, clone, to(dtype/device), zeros_like, empty_like,
//                 detach: a DTensor of the same spec over the local result
#include "dtensor/rules.h"

namespace tessera::detail {

namespace {

TensorList elementwise(OpCall& call) {
  const DTensorSpec& ref = dtensor_spec(*first_dtensor(call.inputs));
  Placements target = ref.placements;
  if (has_partial(target) && !call.attrs.linear) target = without_partial(target);
  TensorList out = call.local(locals_at(call, ref, target));
  for (auto& t : out)
    if (t.defined()) t = make_dtensor(t, ref.mesh, target, ref.global_shape);
  return out;
}

TensorList inplace(OpCall& call) {
  const Tensor& target = call.inputs[0];
  TS_CHECK(target.is_subclass(), "{}: updating a plain tensor from a DTensor; use to_local() or full_tensor()",
           call.name);
  const DTensorSpec& ref = dtensor_spec(target);
  for (size_t i = 1; i < call.inputs.size(); ++i) {
    const Tensor& t = call.inputs[i];
    if (!t.defined() || is_scalar_plain(t)) continue;
    TS_CHECK(t.is_subclass(), "{}: operand {} is a plain tensor of shape {}; in-place updates of a DTensor take "
             "DTensors with the same placements (or scalars)", call.name, i, shape_str(t.shape()));
    const DTensorSpec& s = dtensor_spec(t);
    TS_CHECK(*s.mesh == *ref.mesh && s.placements == ref.placements && s.global_shape == ref.global_shape,
             "{}: operand {} is {} but the target is {}: in-place updates run on local shards and need equal "
             "specs",
             call.name, i, s.str(), ref.str());
  }
  call.local(locals_at(call, ref, ref.placements));
  return {target};
}

// The bias's placements for an input laid out as px: split as the input's
// last (feature) dim, whole elsewhere.
Placements bias_layout(const Placements& px, int64_t last) {
  Placements pb;
  for (const Placement& p : px) pb.push_back(is_shard(p, last) ? moved_to(p, 0) : Placement{Replicate{}});
  return pb;
}

TensorList bias_gelu(OpCall& call) {
  const bool backward = call.op == OpId::bias_gelu_backward;  // {grad, x, bias}, else {x, bias}
  const Tensor& x = call.inputs[backward ? 1 : 0];
  const Tensor& bias = call.inputs[backward ? 2 : 1];
  for (const Tensor* t : {&x, &bias})
    TS_CHECK(t->is_subclass(), "{}: mixes DTensors and plain tensors (the {} is plain); distribute every operand",
             call.name, t == &x ? "input" : "bias");
  const DTensorSpec& s = dtensor_spec(x);
  TS_CHECK(*dtensor_spec(bias).mesh == *s.mesh, "{}: the input and the bias are on different meshes ({} and {})",
           call.name, s.mesh->str(), dtensor_spec(bias).mesh->str());
  const int64_t last = static_cast<int64_t>(s.global_shape.size()) - 1;
  const Placements px = without_partial(s.placements), pb = bias_layout(px, last);
  if (!backward) {
    Tensor y = call.local({local_at(x, px), local_at(bias, pb)})[0];
    return {make_dtensor(y, s.mesh, px, s.global_shape)};
  }
  const Tensor& grad = call.inputs[0];
  TS_CHECK(grad.is_subclass() && *dtensor_spec(grad).mesh == *s.mesh,
           "{}: the input is {} but its gradient is not a DTensor on the same mesh", call.name, s.str());
  TensorList local = call.local({local_at(grad, px), local_at(x, px), local_at(bias, pb)});
  Placements summed = pb;  // over the rows each rank holds: Partial where they are split
  for (size_t i = 0; i < px.size(); ++i)
    if (is_shard(px[i]) && !is_shard(px[i], last)) summed[i] = Partial{dist::ReduceOp::Sum};
  return {make_dtensor(local[0], s.mesh, px, s.global_shape),
          make_dtensor(local[1], s.mesh, summed, Shape{s.global_shape.back()})};
}

TensorList like(OpCall& call) {
  const DTensorSpec& ref = dtensor_spec(call.inputs[0]);
  Tensor local = call.local({ref.local})[0];
  return {make_dtensor(local, ref.mesh, ref.placements, ref.global_shape)};
}

}  // namespace

void register_pointwise_rules() {
  for (OpId op : {OpId::unary, OpId::unary_backward, OpId::binary, OpId::where, OpId::swiglu, OpId::swiglu_backward})
    register_rule(op, elementwise);
  register_rule(OpId::bias_gelu, bias_gelu);
  register_rule(OpId::bias_gelu_backward, bias_gelu);
  for (OpId op : {OpId::copy_, OpId::fill_, OpId::add_, OpId::mul_, OpId::div_, OpId::addcmul_, OpId::addcdiv_,
                  OpId::lerp_, OpId::sqrt_, OpId::clamp_})
    register_rule(op, inplace);
  for (OpId op : {OpId::contiguous, OpId::clone, OpId::to_dtype, OpId::to_device, OpId::zeros_like, OpId::empty_like,
                  OpId::detach})
    register_rule(op, like);
}

}  // namespace tessera::detail
