// Placements: how a DTensor is laid out along one mesh dimension. Value types,
// compared by value, printed as PyTorch prints them (S(0), R, P(sum)).
#pragma once

#include <string>
#include <variant>
#include <vector>

#include "runtime/distributed.h"

namespace tessera {

// Each rank along the mesh dim holds a torch.chunk piece of tensor dim `dim`
// (chunks of ceil(n/k); trailing ranks may hold fewer rows or none).
struct Shard {
  int64_t dim = 0;
  friend bool operator==(const Shard& a, const Shard& b) { return a.dim == b.dim; }
};
// Every rank holds the whole tensor.
struct Replicate {
  friend bool operator==(const Replicate&, const Replicate&) { return true; }
};
// Every rank holds a partial value; the tensor is their reduction.
struct Partial {
  dist::ReduceOp op = dist::ReduceOp::Sum;
  friend bool operator==(const Partial& a, const Partial& b) { return a.op == b.op; }
};

using Placement = std::variant<Shard, Replicate, Partial>;
using Placements = std::vector<Placement>;

inline bool is_shard(const Placement& p) { return std::holds_alternative<Shard>(p); }
inline bool is_shard(const Placement& p, int64_t dim) { return is_shard(p) && std::get<Shard>(p).dim == dim; }
inline bool is_replicate(const Placement& p) { return std::holds_alternative<Replicate>(p); }
inline bool is_partial(const Placement& p) { return std::holds_alternative<Partial>(p); }
inline int64_t shard_dim(const Placement& p) { return std::get<Shard>(p).dim; }

std::string placement_str(const Placement& p);    // "S(0)", "R", "P(sum)"
std::string placements_str(const Placements& p);  // "(R, S(0))"

// torch.chunk along one mesh dim: the length and start of chunk `index` of `n`
// rows split `k` ways (chunk = ceil(n/k); 17 on 4 -> 5,5,5,2; 5 on 4 -> 2,2,1,0).
std::pair<int64_t, int64_t> shard_size_and_offset(int64_t n, int64_t k, int64_t index);

}  // namespace tessera
