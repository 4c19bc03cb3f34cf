// Shared pieces of the DTensor tests: the meshes to try at this world size,
// exact integer-valued data, and DTensors built from a full tensor every rank
// knows (Partial ones as rank contributions that sum to it).
#pragma once

#include <vector>

#include "dtensor/redistribute.h"
#include "tests/helpers.h"

namespace tessera::testing {

inline const dist::ReduceOp kReduceOps[] = {dist::ReduceOp::Sum, dist::ReduceOp::Avg, dist::ReduceOp::Max,
                                            dist::ReduceOp::Min};

inline int world() {
  dist::init();
  return dist::world_size();
}

// Integer-valued f64 data: every sum and gather is exact, so checks are bitwise.
inline Tensor ints(const Shape& s, uint64_t seed) {
  return ops::to(randint(s, -9, 10, seed), DType::F64);
}

// The meshes to test at this world size: 1-D, and every 2-D factorisation.
inline std::vector<MeshPtr> meshes() {
  int w = world();
  std::vector<MeshPtr> out{init_device_mesh("cpu", {w}, {"dp"})};
  for (int a = 1; a <= w; ++a)
    if (w % a == 0) out.push_back(init_device_mesh("cpu", {a, w / a}, {"rep", "shard"}));
  return out;
}

inline Tensor full_like_value(const Tensor& t, double v) { return full(t.shape(), v, t.dtype(), t.device()); }

inline std::vector<Placement> all_1d() { return {Shard{0}, Shard{1}, Replicate{}, Partial{}}; }

// A DTensor holding `full` with placements (Partial: rank contributions that sum to full).
inline Tensor make_from_full(const Tensor& full, const MeshPtr& mesh, const Placements& ps) {
  Placements no_partial = ps;
  std::vector<int64_t> partial_dims;
  for (size_t i = 0; i < ps.size(); ++i)
    if (is_partial(ps[i])) {
      no_partial[i] = Replicate{};
      partial_dims.push_back(static_cast<int64_t>(i));
    }
  Tensor dt = distribute_tensor_local(full, mesh, no_partial);
  if (partial_dims.empty()) return dt;
  // Along each partial dim, coordinate 0 keeps value - (k-1) * 3, the others hold 3.
  Tensor local = ops::clone(local_tensor(dt));
  for (int64_t i : partial_dims) {
    int64_t k = mesh->size(i);
    if (mesh->get_local_rank(i) == 0) local = ops::add(local, -3.0 * static_cast<double>(k - 1));
    else local = full_like_value(local, 3.0);
  }
  return make_dtensor(local, mesh, ps, full.shape());
}


}  // namespace tessera::testing
