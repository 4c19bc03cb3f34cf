// Redistribute: each source -> destination placement transition on one mesh
// dim is one small function on local tensors; a plan orders them over the
// mesh dims (inner dims unsharded first, then outer dims sharded first, so
// nested shards of one tensor dim come out in torch.chunk order).
//
//   Shard(d)   -> Replicate   all-gather along d (padded to equal chunks, unpadded after)
//   Partial    -> Replicate   all-reduce
//   Partial    -> Shard(d)    reduce-scatter along d (padded, unpadded)
//   Replicate  -> Shard(d)    local chunk (no communication)
//   Shard(a)   -> Shard(b)    all-to-all
//   Replicate  -> Partial     local: sum divides by the group size, avg/max/min keep the value
//   Shard      -> Partial     all-gather, then as Replicate -> Partial
//
// A blocked Shard (S(d)xb) is the plain one on the inner dim of d viewed as
// [b, n / b]: its all-gather, chunking and reduce-scatter are the plain
// ones on that view (per_block); a move to another Shard goes through
// Replicate.
#include "dtensor/redistribute.h"

#include <numeric>

#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera {

namespace {

// Puts dim d first (and returns the permutation that undoes it).
std::pair<Tensor, std::vector<int64_t>> dim_first(const Tensor& x, int64_t d) {
  std::vector<int64_t> perm{d}, inverse(static_cast<size_t>(x.dim()));
  for (int64_t i = 0; i < x.dim(); ++i)
    if (i != d) perm.push_back(i);
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  return {d == 0 ? ops::contiguous(x) : ops::contiguous(ops::permute(x, perm)), inverse};
}

Tensor restore(const Tensor& x, const std::vector<int64_t>& inverse, int64_t d) {
  return d == 0 ? ops::contiguous(x) : ops::contiguous(ops::permute(x, inverse));
}

// x with dim 0 padded (with zeros) or cut to `rows`.
Tensor pad_rows(const Tensor& x, int64_t rows) {
  if (x.size(0) == rows) return x;
  Shape s = x.shape();
  s[0] = rows;
  Tensor out = zeros(s, x.dtype(), x.device());
  Tensor dst = ops::narrow(out, 0, 0, std::min(rows, x.size(0)));
  ops::copy_(dst, ops::narrow(x, 0, 0, std::min(rows, x.size(0))));
  return out;
}

Tensor flat(const Tensor& x) { return ops::reshape(x, {x.numel()}); }

}  // namespace

Tensor shard_to_replicate(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t d, int64_t n) {
  int64_t k = g->size();
  if (k == 1) return local;
  int64_t c = (n + k - 1) / k;
  auto [front, inverse] = dim_first(local, d);
  Tensor send = ops::contiguous(pad_rows(front, c));
  Shape out_shape = send.shape();
  out_shape[0] = k * c;
  Tensor out = empty(out_shape, local.dtype(), local.device());
  g->all_gather_into_tensor(flat(out), flat(send))->wait();
  return restore(ops::narrow(out, 0, 0, n), inverse, d);
}

Tensor replicate_to_shard(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t d, int64_t n) {
  if (g->size() == 1) return local;
  auto [len, start] = shard_size_and_offset(n, g->size(), g->rank());
  return ops::contiguous(ops::narrow(local, d, start, len));
}

Tensor partial_to_replicate(const Tensor& local, const dist::ProcessGroupPtr& g, dist::ReduceOp op) {
  if (g->size() == 1) return local;
  Tensor t = ops::clone(local);  // the source DTensor keeps its partial value
  g->all_reduce(t, {op})->wait();
  return t;
}

Tensor partial_to_shard(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t d, int64_t n,
                        dist::ReduceOp op) {
  int64_t k = g->size();
  if (k == 1) return local;
  int64_t c = (n + k - 1) / k;
  auto [front, inverse] = dim_first(local, d);
  Tensor send = ops::contiguous(pad_rows(front, k * c));
  Shape out_shape = send.shape();
  out_shape[0] = c;
  Tensor out = empty(out_shape, local.dtype(), local.device());
  g->reduce_scatter_tensor(flat(out), flat(send), {op})->wait();
  auto [len, start] = shard_size_and_offset(n, k, g->rank());
  return restore(ops::narrow(out, 0, 0, len), inverse, d);
}

Tensor replicate_to_partial(const Tensor& local, const dist::ProcessGroupPtr& g, dist::ReduceOp op) {
  if (g->size() == 1 || op != dist::ReduceOp::Sum) return local;
  return ops::mul(local, 1.0 / static_cast<double>(g->size()));
}

Tensor shard_to_shard(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t a, int64_t na, int64_t b,
                      int64_t nb) {
  int64_t k = g->size();
  if (k == 1) return local;
  int64_t ca = (na + k - 1) / k, cb = (nb + k - 1) / k;
  // Layout [b, a, others...] with a padded to ca and b to k * cb.
  std::vector<int64_t> perm{b, a};
  for (int64_t i = 0; i < local.dim(); ++i)
    if (i != a && i != b) perm.push_back(i);
  Tensor t = ops::contiguous(ops::permute(local, perm));
  t = pad_rows(t, k * cb);
  t = ops::contiguous(ops::transpose(pad_rows(ops::contiguous(ops::transpose(t, 0, 1)), ca), 0, 1));
  // Chunk j of dim b goes to rank j; from rank i comes its a-rows of my b-chunk.
  Tensor recv = empty(t.shape(), t.dtype(), t.device());
  g->all_to_all(flat(recv), flat(t))->wait();
  Shape rest(t.shape().begin() + 2, t.shape().end());
  Shape four{k, cb, ca};
  four.insert(four.end(), rest.begin(), rest.end());
  Tensor r = ops::reshape(recv, four);                       // [i, cb, ca, rest]
  r = ops::contiguous(ops::transpose(r, 1, 2));              // [i, ca, cb, rest]
  Shape merged{k * ca, cb};
  merged.insert(merged.end(), rest.begin(), rest.end());
  r = ops::reshape(r, merged);                               // [a (padded), b chunk, rest]
  auto [lb, start_b] = shard_size_and_offset(nb, k, g->rank());
  r = ops::narrow(ops::narrow(r, 0, 0, na), 1, 0, lb);
  // Back from [a, b, others...] to the original dim order.
  std::vector<int64_t> now{a, b};
  for (int64_t i = 0; i < local.dim(); ++i)
    if (i != a && i != b) now.push_back(i);
  std::vector<int64_t> inverse(now.size());
  for (size_t i = 0; i < now.size(); ++i) inverse[static_cast<size_t>(now[i])] = static_cast<int64_t>(i);
  return ops::contiguous(ops::permute(r, inverse));
}

namespace {
// Size of tensor dim d as seen by mesh dim `level`: the global size cut by the
// shards of dim d on the mesh dims before it.
int64_t level_size(const Shape& global, const DeviceMesh& mesh, const Placements& cur, int64_t level, int64_t d) {
  int64_t n = global[static_cast<size_t>(d)];
  for (int64_t j = 0; j < level; ++j)
    if (is_shard(cur[static_cast<size_t>(j)], d))
      n = shard_length(n, cur[static_cast<size_t>(j)], mesh.size(j), mesh.get_local_rank(j));
  return n;
}

// f(local, dim, size) on dim d of size n; for a Shard of b > 1 blocks, on the
// inner dim of d viewed as [b, n / b] (every block chunked alike), d merged after.
template <class F>
Tensor per_block(const Tensor& local, int64_t d, int64_t n, int64_t b, F&& f) {
  if (b == 1) return f(local, d, n);
  TS_CHECK(n % b == 0 && local.size(d) % b == 0, "redistribute: dim {} ({} here, {} in all) does not split into "
           "{} equal blocks", d, local.size(d), n, b);
  Shape split = local.shape();
  split[static_cast<size_t>(d)] = local.size(d) / b;
  split.insert(split.begin() + d, b);
  Tensor r = f(ops::reshape(ops::contiguous(local), split), d + 1, n / b);
  Shape merged = r.shape();
  merged[static_cast<size_t>(d)] *= merged[static_cast<size_t>(d) + 1];
  merged.erase(merged.begin() + d + 1);
  return ops::reshape(ops::contiguous(r), merged);
}
}  // namespace

Tensor redistribute_local(const Tensor& dt, const Placements& target) {
  const DTensorSpec& spec = dtensor_spec(dt);
  const DeviceMesh& mesh = *spec.mesh;
  Placements dst = normalize_placements(target, mesh, static_cast<int64_t>(spec.global_shape.size()), "redistribute");
  if (dst == spec.placements) return dt;
  Placements cur = spec.placements;
  Tensor local = spec.local;
  const Shape& global = spec.global_shape;
  int64_t nd = mesh.ndim();
  auto shards_elsewhere = [&](int64_t i, int64_t d) {
    for (int64_t j = 0; j < nd; ++j)
      if (j != i && (is_shard(cur[static_cast<size_t>(j)], d) || is_shard(dst[static_cast<size_t>(j)], d))) return true;
    return false;
  };
  // Phase 1, inner mesh dims first: unshard every dim that changes (a Shard ->
  // Shard move on its own is left to the all-to-all), and every shard nested
  // inside an outer dim whose sharding of the same tensor dim changes.
  for (int64_t i = nd - 1; i >= 0; --i) {
    const Placement& c = cur[static_cast<size_t>(i)];
    if (!is_shard(c)) continue;
    int64_t d = shard_dim(c);
    bool changes = c != dst[static_cast<size_t>(i)];
    bool all_to_all = changes && is_shard(dst[static_cast<size_t>(i)]) && !is_blocked(c) &&
                      !is_blocked(dst[static_cast<size_t>(i)]) && !shards_elsewhere(i, d) &&
                      !shards_elsewhere(i, shard_dim(dst[static_cast<size_t>(i)]));
    bool outer_changes = false;
    for (int64_t j = 0; j < i; ++j)
      if (cur[static_cast<size_t>(j)] != dst[static_cast<size_t>(j)] &&
          (is_shard(cur[static_cast<size_t>(j)], d) || is_shard(dst[static_cast<size_t>(j)], d)))
        outer_changes = true;
    if ((changes && !all_to_all) || outer_changes) {
      auto g = mesh.get_group(i);
      local = per_block(local, d, level_size(global, mesh, cur, i, d), shard_blocks(c),
                        [&](const Tensor& x, int64_t dim, int64_t n) { return shard_to_replicate(x, g, dim, n); });
      cur[static_cast<size_t>(i)] = Replicate{};
    }
  }
  // Phase 2, outer mesh dims first: move each dim to its target.
  for (int64_t i = 0; i < nd; ++i) {
    const Placement c = cur[static_cast<size_t>(i)];
    const Placement& t = dst[static_cast<size_t>(i)];
    if (c == t) continue;
    auto g = mesh.get_group(i);
    if (is_shard(c) && is_shard(t)) {
      int64_t a = shard_dim(c), b = shard_dim(t);
      local = shard_to_shard(local, g, a, level_size(global, mesh, cur, i, a), b, level_size(global, mesh, cur, i, b));
    } else if (is_replicate(c) && is_shard(t)) {
      local = per_block(local, shard_dim(t), level_size(global, mesh, cur, i, shard_dim(t)), shard_blocks(t),
                        [&](const Tensor& x, int64_t dim, int64_t n) { return replicate_to_shard(x, g, dim, n); });
    } else if (is_partial(c) && is_replicate(t)) {
      local = partial_to_replicate(local, g, std::get<Partial>(c).op);
    } else if (is_partial(c) && is_shard(t)) {
      const dist::ReduceOp op = std::get<Partial>(c).op;
      local = per_block(local, shard_dim(t), level_size(global, mesh, cur, i, shard_dim(t)), shard_blocks(t),
                        [&](const Tensor& x, int64_t dim, int64_t n) { return partial_to_shard(x, g, dim, n, op); });
    } else if (is_replicate(c) && is_partial(t)) {
      local = replicate_to_partial(local, g, std::get<Partial>(t).op);
    } else {
      TS_CHECK(false, "redistribute: {} -> {} on mesh dim {} is not supported (only for internal use in "
               "PyTorch too: reduce the partial value first)",
               placement_str(c), placement_str(t), i);
    }
    cur[static_cast<size_t>(i)] = t;
  }
  return make_dtensor(local, spec.mesh, dst, global);
}

}  // namespace tessera
