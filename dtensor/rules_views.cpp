// Views and layouts: view, reshape, permute and transpose of DTensors, and a
// gradient laid out as its parameter. Views by strides (narrow, select,
// expand, ...), cat and stack have no rule.
#include <algorithm>

#include "dtensor/rules.h"
#include "runtime/ops.h"

namespace tessera::detail {

namespace {

// permute: the splits follow their dims. reshape: a split dim must stay the
// outermost of the dims it is merged with or split into, and every rank's
// shard must be whole rows of the new dims (checked for every rank, so that
// all refuse alike); Partial sums pass through (the view is linear).
TensorList view_rule(OpCall& call) {
  const Tensor& x = call.inputs[0];
  const DTensorSpec& s = dtensor_spec(x);
  const Shape& in = s.global_shape;
  const Shape& shape = call.attrs.shape;
  Placements out_p = s.placements;
  if (call.op == OpId::permute || call.op == OpId::transpose) {
    const std::vector<int64_t>& perm = call.attrs.dims;
    for (auto& p : out_p) {
      if (!is_shard(p)) continue;
      auto it = std::find(perm.begin(), perm.end(), shard_dim(p));
      p = Shard{static_cast<int64_t>(it - perm.begin())};
    }
    Tensor local = ops::permute(s.local, perm);
    return {make_dtensor(local, s.mesh, out_p, shape)};
  }
  // Blocks of input and output dims with equal products (as a reshape groups them).
  const int64_t ni = static_cast<int64_t>(in.size()), no = static_cast<int64_t>(shape.size());
  auto prod = [](const Shape& sh, int64_t a, int64_t b) {
    int64_t p = 1;
    for (int64_t d = a; d < b; ++d) p *= sh[static_cast<size_t>(d)];
    return p;
  };
  for (size_t i = 0; i < out_p.size(); ++i) {
    if (!is_shard(out_p[i])) continue;
    const int64_t d = shard_dim(out_p[i]);
    for (size_t j = 0; j < out_p.size(); ++j)
      TS_CHECK(j == i || !is_shard(out_p[j], d), "{}: {} {} -> {}: dim {} is split over two mesh dims; redistribute "
               "first", call.name, s.str(), shape_str(in), shape_str(shape), d);
    // P(sh, k): the product of sh's first k sizes. Dim d becomes output dim o0
    // where the products before them agree; then either output dims [o0, o1)
    // make up dim d (a split, or the same dim), or input dims [d, i1) make up
    // dim o0 (a merge). A block that both merges and splits is refused.
    auto P = [&](const Shape& sh, int64_t k) { return prod(sh, 0, k); };
    int64_t o0 = -1, in_row = 1, out_row = 1, i1 = d + 1, o1 = 0;
    for (int64_t o = 0; o < no && o0 < 0; ++o)
      if (P(shape, o) == P(in, d) && (shape[static_cast<size_t>(o)] > 1 || in[static_cast<size_t>(d)] <= 1)) o0 = o;
    bool ok = o0 >= 0;
    if (ok) {
      o1 = o0 + 1;
      while (o1 < no && P(shape, o1) < P(in, d + 1)) ++o1;
      if (P(shape, o1) == P(in, d + 1)) {
        out_row = prod(shape, o0 + 1, o1);
      } else {
        while (i1 < ni && P(in, i1) < P(shape, o0 + 1)) ++i1;
        ok = P(in, i1) == P(shape, o0 + 1);
        in_row = prod(in, d + 1, i1);
      }
    }
    TS_CHECK(ok, "{}: {} {} -> {}: the split dim {} would not be the outermost of the new dims it becomes; "
             "redistribute it first", call.name, s.str(), shape_str(in), shape_str(shape), d);
    // Every rank's rows of dim d must be whole rows of output dim o0.
    const int64_t n = s.mesh->size(static_cast<int64_t>(i));
    for (int64_t r = 0; r < n; ++r) {
      auto [a_len, a_off] = shard_size_and_offset(in[static_cast<size_t>(d)], n, r);
      auto [b_len, b_off] = shard_size_and_offset(shape[static_cast<size_t>(o0)], n, r);
      TS_CHECK(a_len * in_row == b_len * out_row && a_off * in_row == b_off * out_row,
               "{}: {} {} -> {}: rank {} of {} on mesh dim {} holds rows {}..{} of dim {}, which are not whole rows "
               "of the new dim {} (size {}); choose sizes that split evenly, or redistribute first",
               call.name, s.str(), shape_str(in), shape_str(shape), r, n, i, a_off, a_off + a_len, d, o0,
               shape[static_cast<size_t>(o0)]);
    }
    out_p[i] = Shard{o0};
  }
  Shape local = local_shape(shape, *s.mesh, out_p, s.mesh->get_coordinate());
  return {make_dtensor(ops::reshape(s.local, local), s.mesh, out_p, shape)};
}

// A gradient laid out as its parameter: Partial -> Replicate is the all-reduce
// sequence parallelism needs for its norms' weights (Megatron's
// allreduce_layernorm_grads, here once per parameter as it accumulates).
TensorList relayout(OpCall& call) {
  const Tensor& g = call.inputs[0];
  const Tensor& like = call.inputs[1];
  TS_CHECK(g.is_subclass() && like.is_subclass(), "{}: expected two DTensors", call.name);
  const DTensorSpec& sg = dtensor_spec(g);
  const DTensorSpec& sl = dtensor_spec(like);
  TS_CHECK(*sg.mesh == *sl.mesh && sg.global_shape == sl.global_shape,
           "{}: gradient {} does not match parameter {} (mesh and global shape)", call.name, sg.str(), sl.str());
  return {sg.placements == sl.placements ? g : redistribute_local(g, sl.placements)};
}


TensorList strided_view_rule(OpCall& call) {
  TS_CHECK(false, "{}: no sharding rule for a DTensor ({}; DTensor views: reshape, view, permute, transpose); use its "
           "local tensor (to_local()) or the whole one (full_tensor())", call.name, call.inputs[0].str());
}

}  // namespace

void register_view_rules() {
  for (OpId op : {OpId::view, OpId::reshape, OpId::permute, OpId::transpose}) register_rule(op, view_rule);
  register_rule(OpId::gradient_layout, relayout);
  register_rule(OpId::strided_view, strided_view_rule);
  register_rule(OpId::cat, no_rule);
  register_rule(OpId::stack, no_rule);
}

}  // namespace tessera::detail
