// Pointwise ops, in-place updates and copies laid out as their input.
//
//   elementwise   same placements in, same out (other DTensors are
//                 redistributed to the first one's); a Partial input is reduced
//                 first, except for ops linear in it (add/sub of Partials,
//                 negation, scaling by a scalar: OpAttrs::linear)
//   in-place      every DTensor operand must share the target's spec; runs on
//                 the local shards with no communication
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

TensorList like(OpCall& call) {
  const DTensorSpec& ref = dtensor_spec(call.inputs[0]);
  Tensor local = call.local({ref.local})[0];
  return {make_dtensor(local, ref.mesh, ref.placements, ref.global_shape)};
}

}  // namespace

void register_pointwise_rules() {
  for (OpId op : {OpId::unary, OpId::unary_backward, OpId::binary, OpId::where, OpId::swiglu, OpId::swiglu_backward})
    register_rule(op, elementwise);
  for (OpId op : {OpId::copy_, OpId::fill_, OpId::add_, OpId::mul_, OpId::div_, OpId::addcmul_, OpId::addcdiv_,
                  OpId::lerp_, OpId::sqrt_, OpId::clamp_})
    register_rule(op, inplace);
  for (OpId op : {OpId::contiguous, OpId::clone, OpId::to_dtype, OpId::to_device, OpId::zeros_like, OpId::empty_like,
                  OpId::detach})
    register_rule(op, like);
}

}  // namespace tessera::detail
