// Reductions.
//
//   sum       a reduced split dim becomes Partial(sum): each rank's sum of its
//             rows, added when the result is redistributed (mean is the sum
//             divided by the global count, runtime/ops_math.cpp)
//   var, max, argmax, sum_squares   refused: take the local tensor or the
//             whole one (a norm of a sharded gradient: nn::grad_norm)
#include "dtensor/rules.h"

namespace tessera::detail {

namespace {

TensorList sum_rule(OpCall& call) {
  const Tensor& x = call.inputs[0];
  const DTensorSpec& ref = dtensor_spec(x);
  int64_t nd = static_cast<int64_t>(ref.global_shape.size());
  std::vector<bool> reduced(static_cast<size_t>(nd), call.attrs.dims.empty());
  for (int64_t d : call.attrs.dims) reduced[static_cast<size_t>(wrap_dim(d, nd, call.name))] = true;
  Placements out_p = ref.placements;
  for (auto& p : out_p) {
    if (!is_shard(p)) continue;
    int64_t d = shard_dim(p);
    if (reduced[static_cast<size_t>(d)]) {
      p = Partial{dist::ReduceOp::Sum};
    } else if (!call.attrs.keepdim) {
      int64_t removed = 0;
      for (int64_t k = 0; k < d; ++k) removed += reduced[static_cast<size_t>(k)];
      p = moved_to(p, d - removed);
    }
  }
  Shape out_shape;
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduced[static_cast<size_t>(d)]) out_shape.push_back(ref.global_shape[static_cast<size_t>(d)]);
    else if (call.attrs.keepdim) out_shape.push_back(1);
  }
  Tensor local = call.local({ref.local})[0];
  return {make_dtensor(local, ref.mesh, out_p, out_shape)};
}

TensorList sum_squares_rule(OpCall&) {
  TS_CHECK(false, "sum_squares of a DTensor would be this rank's part only; use nn::grad_norm / clip_grad_norm_ "
           "(which reduce across ranks) or sum(x * x) and full_tensor()");
}

}  // namespace

void register_reduction_rules() {
  register_rule(OpId::sum, sum_rule);
  register_rule(OpId::sum_squares, sum_squares_rule);
  for (OpId op : {OpId::var, OpId::max, OpId::argmax}) register_rule(op, no_rule);
}

}  // namespace tessera::detail
