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
//
// With blocks > 1 the dim is `blocks` equal blocks laid end to end, each
// chunked on its own, and a rank holds its chunk of every block, in block
// order: a fused projection's output (GPT-2's c_attn, [q | k | v]) split so
// that each rank gets its share of q, of k and of v (Megatron's fused QKV;
// PyTorch's _StridedShard with split_factor = blocks). Printed S(0)x3.
struct Shard {
  int64_t dim = 0;
  int64_t blocks = 1;
  friend bool operator==(const Shard& a, const Shard& b) { return a.dim == b.dim && a.blocks == b.blocks; }
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
inline int64_t shard_blocks(const Placement& p) { return is_shard(p) ? std::get<Shard>(p).blocks : 1; }
inline bool is_blocked(const Placement& p) { return shard_blocks(p) > 1; }
// The same placement on another tensor dim (a Shard keeps its blocks).
inline Placement moved_to(const Placement& p, int64_t dim) {
  return is_shard(p) ? Placement{Shard{dim, shard_blocks(p)}} : p;
}

std::string placement_str(const Placement& p);    // "S(0)", "S(0)x3", "R", "P(sum)"
std::string placements_str(const Placements& p);  // "(R, S(0))"

// torch.chunk along one mesh dim: the length and start of chunk `index` of `n`
// rows split `k` ways (chunk = ceil(n/k); 17 on 4 -> 5,5,5,2; 5 on 4 -> 2,2,1,0).
std::pair<int64_t, int64_t> shard_size_and_offset(int64_t n, int64_t k, int64_t index);

// Runs of global indices: [start, start + length) each, in local order.
using Runs = std::vector<std::pair<int64_t, int64_t>>;
// What `p`, at position `index` of `k` ranks, keeps of a dim whose local
// indices cover `runs` (a Shard one chunk of them, a blocked Shard one chunk
// of each block; others all). Throws when a blocked dim does not split into
// its blocks evenly.
Runs shard_runs(const Runs& runs, const Placement& p, int64_t k, int64_t index);
// The length of a dim of `n` after `p` at `index` of `k`.
int64_t shard_length(int64_t n, const Placement& p, int64_t k, int64_t index);

}  // namespace tessera
