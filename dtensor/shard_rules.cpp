#include "dtensor/shard_rules.h"

#include <algorithm>

#include "dtensor/dtensor.h"
#include "dtensor/redistribute.h"
#include "runtime/ops.h"

namespace tessera::detail {

// An op independent along call.free_dims (softmax away from its dim, attention
// and RoPE over batch and heads): the inputs keep their splits on those dims,
// anything else is gathered first (a split softmax dim, a split sequence in
// attention; Partial sums are reduced), and each rank runs the op on its shards.
std::vector<Tensor> per_shard_rule(DistCall& call) {
  const Tensor* first = nullptr;
  for (const Tensor& t : call.inputs)
    if (first == nullptr && t.defined() && t.is_distributed()) first = &t;
  const DTensorSpec& ref = dtensor_spec(*first);
  const int64_t nd = static_cast<int64_t>(ref.global_shape.size());
  auto is_free = [&](int64_t d) {
    return std::find(call.free_dims.begin(), call.free_dims.end(), d) != call.free_dims.end();
  };
  Placements target = ref.placements;
  for (auto& p : target)
    if (is_partial(p) || (is_shard(p) && !is_free(shard_dim(p) < 0 ? shard_dim(p) + nd : shard_dim(p))))
      p = Replicate{};
  std::vector<Tensor> locals;
  for (const Tensor& t : call.inputs) {
    if (!t.defined() || !t.is_distributed()) {  // plain: the same whole tensor on every rank (RoPE's angles)
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
  std::vector<Tensor> out = call.local(locals);
  for (size_t k = 0; k < out.size(); ++k) {
    if (!out[k].defined()) continue;
    const size_t like = k < call.out_like.size() ? static_cast<size_t>(call.out_like[k]) : 0;
    const Shape& like_global = dtensor_spec(call.inputs[like]).global_shape;
    Shape global = out[k].shape();
    for (const auto& p : target)
      if (is_shard(p)) global[static_cast<size_t>(shard_dim(p))] = like_global[static_cast<size_t>(shard_dim(p))];
    out[k] = make_dtensor(out[k], ref.mesh, target, global);
  }
  return out;
}

// permute: the splits follow their dims. reshape: a split dim must stay the
// outermost of the dims it is merged with or split into, and every rank's
// shard must be whole rows of the new dims (checked for every rank, so that
// all refuse alike); Partial sums pass through (the view is linear).
std::vector<Tensor> view_rule(DistCall& call) {
  const Tensor& x = call.inputs[0];
  const DTensorSpec& s = dtensor_spec(x);
  const Shape& in = s.global_shape;
  const Shape& shape = call.shape;
  Placements out_p = s.placements;
  if (!call.perm.empty()) {
    for (auto& p : out_p) {
      if (!is_shard(p)) continue;
      auto it = std::find(call.perm.begin(), call.perm.end(), shard_dim(p));
      p = Shard{static_cast<int64_t>(it - call.perm.begin())};
    }
    Tensor local = ops::permute(s.local, call.perm);
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

}  // namespace tessera::detail
