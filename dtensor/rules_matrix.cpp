// Matrix products: linear(x, w[, b]) and matmul(a, b), split mesh dim by mesh
// dim from their operands' placements, and linear's backward.
//
//   Replicate x Shard(0) weight [out, in]   -> Shard(-1)   (column-wise)
//   Shard(-1) x Shard(1) weight             -> Partial     (row-wise)
//   batch-sharded input x Replicate weight  -> the same batch shard
//   Replicate x Replicate                   -> Replicate
// A blocked weight shard (S(0)x3: a fused q, k, v projection) keeps its blocks.
#include "dtensor/rules.h"

#include "runtime/ops.h"

namespace tessera::detail {

namespace {

// How a linear / matmul is split along one mesh dim, from its operands' placements.
enum class Split {
  Replicated,  // R x R -> R
  Colwise,     // R x S(out) -> S(-1): each rank computes some output features
  Rowwise,     // S(-1) x S(in) -> P: each rank sums over some input features
  Rows,        // S(batch) x R -> S(batch): each rank computes some rows
};

// The split of mesh dim i; a_dims/w_dims are the operands' ranks, w_out/w_in
// the weight's output- and input-feature dims.
Split split_of(const OpCall& call, const Placement& pa, const Placement& pw, size_t i, int64_t a_dims, int64_t w_dims,
               int64_t w_out, int64_t w_in) {
  if (is_replicate(pa) && is_replicate(pw)) return Split::Replicated;
  if (is_replicate(pa) && w_dims == 2 && is_shard(pw, w_out)) return Split::Colwise;
  if (is_shard(pa, a_dims - 1) && w_dims == 2 && is_shard(pw, w_in) && shard_blocks(pa) == shard_blocks(pw))
    return Split::Rowwise;  // (equal blocks: both hold the same input features, in the same order)
  if (is_shard(pa) && shard_dim(pa) < a_dims - 1 && is_replicate(pw)) return Split::Rows;
  TS_CHECK(false,
           "{}: no sharding rule for input {} and weight {} on mesh dim {} (supported: R x S(out) -> S(-1), "
           "S(-1) x S(in) -> P, S(batch) x R -> S(batch), R x R -> R)",
           call.name, placement_str(pa), placement_str(pw), i);
  return Split::Replicated;
}

TensorList linear_rule(OpCall& call) {
  const bool is_linear = call.op == OpId::linear;  // else matmul
  const Tensor& a = call.inputs[0];
  const Tensor& w = call.inputs[1];
  const Tensor* bias = is_linear && call.inputs.size() > 2 && call.inputs[2].defined() ? &call.inputs[2] : nullptr;
  for (const Tensor* t : {&a, &w})
    TS_CHECK(t->is_subclass(), "{}: mixes DTensors and plain tensors; distribute every operand", call.name);
  const DTensorSpec& sa = dtensor_spec(a);
  const DTensorSpec& sw = dtensor_spec(w);
  TS_CHECK(*sa.mesh == *sw.mesh, "{}: operands on different meshes", call.name);
  int64_t ad = static_cast<int64_t>(sa.global_shape.size());
  int64_t wd = static_cast<int64_t>(sw.global_shape.size());
  // The output's global shape, from the op's own shape rule (not by running
  // it on meta: a planned step logs every meta kernel it runs).
  const Shape out_shape = is_linear ? ops::linear_shape(sa.global_shape, sw.global_shape)
                                         : ops::matmul_shape(sa.global_shape, sw.global_shape);
  int64_t od = static_cast<int64_t>(out_shape.size());
  // In linear, w is [out, in]: its "output features" dim is 0 and "input" dim is 1;
  // in matmul(a [.., k], b [k, n]) they are 1 and 0.
  int64_t w_out = is_linear ? 0 : wd - 1, w_in = is_linear ? 1 : wd - 2;
  Placements out_p;
  for (size_t i = 0; i < sa.placements.size(); ++i) {
    const Placement& pa = sa.placements[i];
    switch (split_of(call, pa, sw.placements[i], i, ad, wd, w_out, w_in)) {
      case Split::Replicated: out_p.push_back(Replicate{}); break;
      case Split::Colwise: out_p.push_back(moved_to(sw.placements[i], od - 1)); break;
      case Split::Rowwise: out_p.push_back(Partial{dist::ReduceOp::Sum}); break;
      case Split::Rows: out_p.push_back(moved_to(pa, shard_dim(pa) + (od - ad))); break;
    }
    if (bias) {
      Placement pb = placement_at(*bias, i);
      bool ok = is_shard(out_p.back(), od - 1) ? pb == moved_to(out_p.back(), 0) : is_replicate(pb);
      TS_CHECK(ok, "{}: bias placement {} does not fit output placement {} on mesh dim {}", call.name,
               placement_str(pb), placement_str(out_p.back()), i);
    }
  }
  TensorList locals{sa.local, sw.local};
  if (bias) {
    // With a Partial output the bias is added by one rank per partial group, so the sum has it once.
    bool mine = true;
    for (size_t i = 0; i < out_p.size(); ++i)
      if (is_partial(out_p[i]) && sa.mesh->get_local_rank(static_cast<int64_t>(i)) != 0) mine = false;
    locals.push_back(mine ? (bias->is_subclass() ? dtensor_spec(*bias).local : *bias) : Tensor());
  } else if (is_linear) {
    locals.push_back(Tensor());
  }
  Tensor local = call.local(locals)[0];
  return {make_dtensor(local, sa.mesh, out_p, out_shape)};
}

// linear's backward, mesh dim by mesh dim from the forward's split: the
// output gradient is first laid out as the forward output was (a Partial
// output's gradient as Replicate), then each rank's local products give
//              dx          dw      db
//   Replicated R           R       R
//   Colwise    P(sum)      S(0)    S(0)    (each rank's features feed all of x)
//   Rowwise    S(-1)       S(1)    R
//   Rows       S(batch)    P(sum)  P(sum)  (each rank saw some rows)
TensorList linear_backward_rule(OpCall& call) {
  const Tensor& g = call.inputs[0];
  const Tensor& x = call.inputs[1];
  const Tensor& w = call.inputs[2];
  for (const Tensor* t : {&g, &x, &w})
    TS_CHECK(t->is_subclass(), "{}: mixes DTensors and plain tensors; distribute every operand", call.name);
  const DTensorSpec& sx = dtensor_spec(x);
  const DTensorSpec& sw = dtensor_spec(w);
  TS_CHECK(*sx.mesh == *sw.mesh && *dtensor_spec(g).mesh == *sx.mesh, "{}: operands on different meshes", call.name);
  const int64_t xd = static_cast<int64_t>(sx.global_shape.size());
  Placements gp, dx_p, dw_p, db_p;
  for (size_t i = 0; i < sx.placements.size(); ++i) {
    const Placement& px = sx.placements[i];
    switch (split_of(call, px, sw.placements[i], i, xd, 2, 0, 1)) {
      case Split::Replicated:
        gp.push_back(Replicate{}), dx_p.push_back(Replicate{}), dw_p.push_back(Replicate{}), db_p.push_back(Replicate{});
        break;
      case Split::Colwise: {
        const Placement& pw = sw.placements[i];  // S(0), or S(0)xb for a fused projection
        gp.push_back(moved_to(pw, xd - 1)), dx_p.push_back(Partial{}), dw_p.push_back(pw), db_p.push_back(pw);
        break;
      }
      case Split::Rowwise:
        gp.push_back(Replicate{}), dx_p.push_back(px), dw_p.push_back(sw.placements[i]), db_p.push_back(Replicate{});
        break;
      case Split::Rows:
        gp.push_back(px), dx_p.push_back(px), dw_p.push_back(Partial{}), db_p.push_back(Partial{});
        break;
    }
  }
  const Tensor g_local = local_at(g, gp);
  TensorList local = call.local({g_local, sx.local, sw.local});
  const int64_t out_features = sw.global_shape[0];
  TensorList d(3);
  if (local[0].defined()) d[0] = make_dtensor(local[0], sx.mesh, dx_p, sx.global_shape);
  if (local[1].defined()) d[1] = make_dtensor(local[1], sx.mesh, dw_p, sw.global_shape);
  if (local[2].defined()) d[2] = make_dtensor(local[2], sx.mesh, db_p, Shape{out_features});
  return d;
}

}  // namespace

void register_matrix_rules() {
  register_rule(OpId::linear, linear_rule);
  register_rule(OpId::matmul, linear_rule);
  register_rule(OpId::linear_backward, linear_backward_rule);
  register_rule(OpId::gemm_into, no_rule);
}

}  // namespace tessera::detail
