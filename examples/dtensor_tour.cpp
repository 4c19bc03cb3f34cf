// A tour of DTensor on a 2x2 mesh: what each rank holds under Shard,
// Replicate and Partial, and what each redistribute sends.
//   mpirun -np 4 --oversubscribe build/examples/dtensor_tour
// (Other rank counts use a 2 x W/2 or 1 x W mesh.) Every layout is checked:
// gathered back, it must be the tensor it started from; the program says
// which collective each change issued and exits 1 if anything differs.
#include <tessera/tessera.h>

#include <cstdio>
#include <string>

using namespace tessera;

namespace {

MeshPtr g_mesh;

// Every rank's text, printed by rank 0 in rank order (gathered as bytes).
void say_all(const std::string& mine) {
  constexpr int64_t kWidth = 256;
  std::vector<int64_t> bytes(kWidth, 0);
  for (size_t i = 0; i < mine.size() && i < kWidth; ++i) bytes[i] = static_cast<unsigned char>(mine[i]);
  auto world = dist::world();
  Tensor all = empty({world->size() * kWidth}, DType::I64);
  world->all_gather_into_tensor(all, from_vector(bytes, {kWidth}))->wait();
  if (dist::rank() != 0) return;
  std::vector<int64_t> got = all.to_vector<int64_t>();
  for (int r = 0; r < world->size(); ++r) {
    std::string line;
    for (int64_t i = 0; i < kWidth && got[r * kWidth + i] != 0; ++i) line.push_back(static_cast<char>(got[r * kWidth + i]));
    std::printf("  %s\n", line.c_str());
  }
}

std::string values(const Tensor& t) {
  std::string s = "[";
  std::vector<double> v = t.to_vector<double>();
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ' ';
    s += fmt::format("{:g}", v[i]);
  }
  return s + "]";
}

// What this rank holds of `d`, for every rank; then `d` gathered must equal `want`.
bool show(const char* title, const Tensor& d, const Tensor& want) {
  if (dist::rank() == 0) std::printf("\n%s: %s\n", title, placements_str(dtensor_spec(d).placements).c_str());
  auto coord = g_mesh->get_coordinate();
  Tensor local = local_tensor(d);
  say_all(fmt::format("rank {} (dp {}, tp {}) holds {} = {}", dist::rank(), coord[0], coord[1],
                      shape_str(local.shape()), values(local)));
  bool same = full_tensor(d).to_vector<double>() == want.to_vector<double>();
  if (!same && dist::rank() == 0) std::printf("  MISMATCH: gathered, this layout is not the tensor it came from\n");
  return same;
}

// The collectives issued on every group of the mesh since the last call.
std::string issued() {
  static dist::CollectiveStats last;
  dist::CollectiveStats now;
  for (int64_t i = 0; i < g_mesh->ndim(); ++i) now += g_mesh->get_group(i)->stats();
  std::string s;
  auto part = [&](int64_t n, const char* what) {
    if (n > 0) s += fmt::format("{}{} {}", s.empty() ? "" : ", ", n, what);
  };
  part(now.all_gather - last.all_gather, "all-gather");
  part(now.reduce_scatter - last.reduce_scatter, "reduce-scatter");
  part(now.all_reduce - last.all_reduce, "all-reduce");
  part(now.all_to_all - last.all_to_all, "all-to-all");
  last = now;
  return s.empty() ? "no communication" : s;
}

}  // namespace

int main(int argc, char** argv) {
  dist::init(argc, argv);
  const int w = dist::world_size();
  const int64_t a = w % 2 == 0 ? 2 : 1;
  g_mesh = init_device_mesh("cpu", {a, w / a}, {"dp", "tp"});
  if (dist::rank() == 0)
    std::printf("mesh %s; the tensor A = 0..23 as [4, 6] (every rank knows it)\n", g_mesh->str().c_str());
  Tensor A = ops::reshape(ops::to(arange(0, 24), DType::F64), {4, 6});
  issued();
  bool ok = true;

  // distribute_tensor: each rank keeps its piece (no communication: every rank has A).
  Tensor rows = distribute_tensor(A, g_mesh, {Shard{0}, Replicate{}});
  ok &= show("rows split over dp, the same rows on both tp ranks (Shard(0), Replicate)", rows, A);
  Tensor blocks = distribute_tensor(A, g_mesh, {Shard{0}, Shard{1}});
  ok &= show("rows over dp and columns over tp: 2-D blocks (Shard(0), Shard(1))", blocks, A);

  // A fused projection's output, [q | k | v] (here A's 6 columns as 3 blocks
  // of 2), split block by block: each tp rank holds its share of every block,
  // so its q, k and v belong to the same heads (GPT-2's c_attn under tensor
  // parallelism).
  Tensor fused = distribute_tensor(A, g_mesh, {Replicate{}, Shard{1, 3}});
  ok &= show("columns as 3 blocks, each split over tp (Replicate, Shard(1)x3)", fused, A);

  // redistribute moves data with collectives.
  // (Each check above gathered its layout; count from here.)
  issued();
  Tensor whole = redistribute(blocks, {Replicate{}, Replicate{}});
  std::string sent = issued();
  ok &= show("blocks -> Replicate everywhere", whole, A);
  if (dist::rank() == 0) std::printf("  (issued: %s: each mesh dim gathers its split)\n", sent.c_str());
  issued();
  Tensor cols = redistribute(rows, {Shard{1}, Replicate{}});
  sent = issued();
  ok &= show("rows over dp -> columns over dp", cols, A);
  if (dist::rank() == 0) std::printf("  (issued: %s: each dp rank sends the other its columns of its rows)\n", sent.c_str());

  // Partial: each rank holds a part of a sum (a gradient before its reduction,
  // a row-wise layer's output). Here rank 0 holds A - (W - 1), the others 1s.
  Tensor share = dist::rank() == 0 ? ops::add(A, -(w - 1.0)) : full(A.shape(), 1.0, DType::F64);
  Tensor parts = from_local(share, g_mesh, {Partial{}, Partial{}});
  ok &= show("pending sums: each rank a part of A (Partial(sum), Partial(sum))", parts, A);
  issued();
  Tensor reduced = redistribute(parts, {Shard{0}, Replicate{}});
  sent = issued();
  ok &= show("Partial -> rows over dp, the same on tp", reduced, A);
  if (dist::rank() == 0) std::printf("  (issued: %s: dp reduce-scatters, tp all-reduces)\n", sent.c_str());

  if (dist::rank() == 0) std::printf("\n%s\n", ok ? "OK: every layout gathers back to A" : "MISMATCH");
  return ok ? 0 : 1;
}
