#include "dtensor/placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/check.h"

namespace tessera {

std::string placement_str(const Placement& p) {
  if (is_blocked(p)) return fmt::format("S({})x{}", shard_dim(p), shard_blocks(p));
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

namespace {
// The local indices [from, from + len) of `runs`, as runs.
Runs take(const Runs& runs, int64_t from, int64_t len) {
  Runs out;
  for (const auto& [start, n] : runs) {
    if (len == 0) break;
    if (from >= n) {
      from -= n;
      continue;
    }
    const int64_t m = std::min(n - from, len);
    out.push_back({start + from, m});
    len -= m;
    from = 0;
  }
  return out;
}

int64_t total(const Runs& runs) {
  int64_t n = 0;
  for (const auto& r : runs) n += r.second;
  return n;
}
}  // namespace

Runs shard_runs(const Runs& runs, const Placement& p, int64_t k, int64_t index) {
  if (!is_shard(p)) return runs;
  const int64_t n = total(runs), b = shard_blocks(p);
  TS_CHECK(b >= 1 && n % b == 0, "{}: a dim of {} does not split into {} equal blocks", placement_str(p), n, b);
  Runs out;
  for (int64_t j = 0; j < b; ++j) {
    auto [len, start] = shard_size_and_offset(n / b, k, index);
    for (const auto& r : take(runs, j * (n / b) + start, len)) {
      if (!out.empty() && out.back().first + out.back().second == r.first) out.back().second += r.second;
      else out.push_back(r);
    }
  }
  return out;
}

int64_t shard_length(int64_t n, const Placement& p, int64_t k, int64_t index) {
  if (!is_shard(p)) return n;
  const int64_t b = shard_blocks(p);
  TS_CHECK(b >= 1 && n % b == 0, "{}: a dim of {} does not split into {} equal blocks", placement_str(p), n, b);
  return b * shard_size_and_offset(n / b, k, index).first;
}

}  // namespace tessera
