#include "dtensor/placement.h"

#include <fmt/format.h>

#include <algorithm>

namespace tessera {

std::string placement_str(const Placement& p) {
  if (is_shard(p)) return fmt::format("S({})", shard_dim(p));
  if (is_replicate(p)) return "R";
  return fmt::format("P({})", dist::reduce_op_name(std::get<Partial>(p).op));
}

std::string placements_str(const Placements& ps) {
  std::vector<std::string> parts;
  for (const auto& p : ps) parts.push_back(placement_str(p));
  return fmt::format("({})", fmt::join(parts, ", "));
}

std::pair<int64_t, int64_t> shard_size_and_offset(int64_t n, int64_t k, int64_t index) {
  int64_t chunk = (n + k - 1) / k;
  int64_t start = std::min(n, chunk * index);
  return {std::min(n, start + chunk) - start, start};
}

}  // namespace tessera
