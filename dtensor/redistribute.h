// The placement transitions on local tensors (one per source -> destination
// pair, each with its own test) and the raw redistribute they compose into.
#pragma once

#include "dtensor/dtensor.h"

namespace tessera {

// n: the size of tensor dim d across the group (before this group's split).
Tensor shard_to_replicate(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t d, int64_t n);
Tensor replicate_to_shard(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t d, int64_t n);
Tensor partial_to_replicate(const Tensor& local, const dist::ProcessGroupPtr& g, dist::ReduceOp op);
Tensor partial_to_shard(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t d, int64_t n,
                        dist::ReduceOp op);
Tensor replicate_to_partial(const Tensor& local, const dist::ProcessGroupPtr& g, dist::ReduceOp op);
Tensor shard_to_shard(const Tensor& local, const dist::ProcessGroupPtr& g, int64_t a, int64_t na, int64_t b,
                      int64_t nb);

// Redistribute without autograd: a new DTensor with the target placements.
Tensor redistribute_local(const Tensor& dtensor, const Placements& placements);
// This rank's local tensor of the DTensor laid out as `placements` (without
// autograd; no communication when it already is).
inline Tensor local_at(const Tensor& dtensor, const Placements& placements) {
  return local_tensor(redistribute_local(dtensor, placements));
}

}  // namespace tessera
