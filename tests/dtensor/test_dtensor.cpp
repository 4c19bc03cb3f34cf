// DeviceMesh, placements, redistribute and DTensor ops, under mpirun with
// 1-4 ranks. Every rank knows the full tensors (built from seeds), so each
// checks its own local piece exactly.
#include <algorithm>
#include <cmath>
#include <functional>

#include "autograd/functions.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules.h"
#include "nn/optim.h"
#include "runtime/cuda_backend.h"
#include "tests/dtensor/dtensor_helpers.h"

using namespace tessera;
using namespace tessera::testing;

TEST_CASE("shard sizes follow torch.chunk", "[dtensor][placement]") {
  auto sizes = [](int64_t n, int64_t k) {
    std::vector<int64_t> out;
    for (int64_t r = 0; r < k; ++r) out.push_back(shard_size_and_offset(n, k, r).first);
    return out;
  };
  CHECK(sizes(17, 4) == std::vector<int64_t>{5, 5, 5, 2});
  CHECK(sizes(5, 4) == std::vector<int64_t>{2, 2, 1, 0});
  CHECK(sizes(1, 2) == std::vector<int64_t>{1, 0});
  CHECK(sizes(7, 2) == std::vector<int64_t>{4, 3});
  CHECK(shard_size_and_offset(5, 4, 3).second == 5);
  CHECK(placements_str({Replicate{}, Shard{0}, Partial{dist::ReduceOp::Avg}}) == "(R, S(0), P(avg))");
}

TEST_CASE("device meshes: dims, groups, slicing, flattening", "[dtensor][mesh]") {
  int w = world(), r = dist::rank();
  auto m1 = init_device_mesh("cpu", {w}, {"dp"});
  CHECK(m1->ndim() == 1);
  CHECK(m1->get_group(0)->size() == w);
  CHECK(m1->get_local_rank("dp") == r);
  CHECK(m1->get_coordinate() == std::vector<int64_t>{r});
  for (int a = 1; a <= w; ++a) {
    if (w % a) continue;
    int b = w / a;
    auto m = init_device_mesh("cpu", {a, b}, {"rep", "shard"});
    CHECK(m->get_coordinate() == std::vector<int64_t>{r / b, r % b});
    CHECK(m->get_group("rep")->size() == a);
    CHECK(m->get_group("shard")->size() == b);
    CHECK(m->get_group("shard")->rank() == r % b);
    auto s = (*m)["shard"];
    CHECK(s->ndim() == 1);
    CHECK(s->size() == b);
    std::vector<int> row;
    for (int k = 0; k < b; ++k) row.push_back((r / b) * b + k);
    CHECK(s->ranks() == row);
    CHECK(s->get_group(0) == m->get_group(1));  // submeshes reuse the parent's groups
    auto both = m->slice({"rep", "shard"});
    CHECK(*both == *m);
    auto flat = m->flatten();
    CHECK(flat->dim_names() == std::vector<std::string>{"rep_shard"});
    CHECK(flat->get_group(0)->size() == w);
    Tensor t = full({1}, 1.0);
    flat->get_group(0)->all_reduce(t)->wait();
    CHECK(t.item() == w);
    CHECK_THROWS_WITH(m->slice({"shard", "rep"}), Catch::Contains("must follow the mesh's order"));
    CHECK_THROWS_WITH((*m)["tp"], Catch::Contains("mesh has no dim named 'tp' (dims: rep, shard)"));
  }
  CHECK_THROWS_WITH(init_device_mesh("cpu", {w + 1}), Catch::Contains("holds " + std::to_string(w + 1)));
  if (!cuda::is_available())
    CHECK_THROWS_WITH(init_device_mesh("cuda", {w}), Catch::Contains("device type 'cuda', but"));
  else if (w > 1)  // no NCCL group yet: refused up front, not at the first collective
    CHECK_THROWS_WITH(init_device_mesh("cuda", {w}), Catch::Contains("needs the NCCL process group"));
  CHECK_THROWS_WITH(init_device_mesh("tpu", {w}), Catch::Contains("unknown device type 'tpu'"));
  CHECK_THROWS_WITH(init_device_mesh("cpu", {w, 1}, {"a", "a"}), Catch::Contains("must be unique"));
}

namespace {
// Every rank of a group's global rank, gathered over the group (in group order).
std::vector<int> group_members(const dist::ProcessGroupPtr& g) {
  Tensor mine = full({1}, static_cast<double>(dist::rank()), DType::F64);
  Tensor all = empty({g->size()}, DType::F64);
  g->all_gather_into_tensor(all, mine)->wait();
  std::vector<int> out;
  for (double v : all.to_vector<double>()) out.push_back(static_cast<int>(v));
  return out;
}

// This rank's piece, cut here in mesh-dim order straight from torch.chunk sizes.
Tensor chunk_piece(const Tensor& full, const DeviceMesh& mesh, const Placements& ps) {
  Tensor t = full;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!is_shard(ps[i])) continue;
    int64_t d = shard_dim(ps[i]);
    auto [len, start] = shard_size_and_offset(t.size(d), mesh.size(static_cast<int64_t>(i)), mesh.get_coordinate()[i]);
    t = ops::narrow(t, d, start, len);
  }
  return ops::contiguous(t);
}
}  // namespace

TEST_CASE("unflattening a dim: the groups of the mesh with that dim split, the others kept", "[dtensor][mesh]") {
  // dp_shard -> (dp_shard_mod_ep, ep), as expert parallelism carves it: the
  // new mesh's groups hold the ranks init_device_mesh gives the 3-D shape.
  const int w = world();
  int tested = 0;
  for (int64_t a = 1; a <= w; ++a) {
    if (w % a) continue;
    const int64_t b = w / a;
    auto m = init_device_mesh("cpu", {a, b}, {"rep", "shard"});
    for (int64_t x = 1; x <= b; ++x) {
      if (b % x) continue;
      const int64_t y = b / x;
      INFO(m->str() << " -> shard as " << x << " x " << y);
      auto u = m->unflatten("shard", {x, y}, {"outer", "inner"});
      auto want = init_device_mesh("cpu", {a, x, y}, {"rep", "outer", "inner"});
      CHECK(u->shape() == Shape{a, x, y});
      CHECK(u->dim_names() == std::vector<std::string>{"rep", "outer", "inner"});
      CHECK(u->get_coordinate() == want->get_coordinate());
      CHECK(u->ranks() == want->ranks());
      CHECK(u->get_group("rep") == m->get_group("rep"));  // kept, not made again
      for (const std::string name : {"outer", "inner"}) {
        CHECK(u->get_group(name)->rank() == want->get_group(name)->rank());
        CHECK(group_members(u->get_group(name)) == group_members(want->get_group(name)));
      }
      // A planned rank's (simulated) mesh unflattens to the same members, without communicating.
      std::vector<dist::ProcessGroupPtr> sim;
      std::vector<int> all(static_cast<size_t>(w));
      for (int i = 0; i < w; ++i) all[static_cast<size_t>(i)] = i;
      for (const std::string name : {"rep", "shard"})
        sim.push_back(dist::simulated_group(static_cast<int>(m->get_local_rank(name)), group_members(m->get_group(name)),
                                            name));
      auto planned = std::make_shared<DeviceMesh>("cpu", m->shape(), all, m->dim_names(), sim, m->get_coordinate())
                         ->unflatten("shard", {x, y}, {"outer", "inner"});
      for (const std::string name : {"outer", "inner"}) {
        CHECK(planned->get_group(name)->simulated());
        CHECK(planned->get_group(name)->global_ranks() == group_members(want->get_group(name)));
        CHECK(planned->get_group(name)->rank() == want->get_group(name)->rank());
      }
      ++tested;
    }
    CHECK_THROWS_WITH(m->unflatten("shard", {b + 1}, {"x"}), Catch::Contains("hold " + std::to_string(b + 1) + " ranks"));
    CHECK_THROWS_WITH(m->unflatten("shard", {b, 1}, {"rep", "x"}), Catch::Contains("must be unique"));
    CHECK_THROWS_WITH(m->unflatten("tp", {1}, {"x"}), Catch::Contains("no dim named 'tp'"));
  }
  CHECK(tested > 0);
}

TEST_CASE("3-D meshes: named dims, coordinates, multi-name slices, flattening, redistribute", "[dtensor][mesh]") {
  int w = world(), r = dist::rank();
  int meshes_tested = 0;
  for (int64_t a = 1; a <= w; ++a) {
    for (int64_t b = 1; b <= w; ++b) {
      if (w % (a * b)) continue;  // every 3-factor shape of this world size (4: 2x1x2, 1x2x2, 4x1x1, ...)
      int64_t c = w / (a * b);
      auto m = init_device_mesh("cpu", {a, b, c}, {"a", "b", "c"});
      INFO(m->str());
      ++meshes_tested;
      std::vector<int64_t> co{r / (b * c), (r / c) % b, r % c};
      CHECK(m->ndim() == 3);
      CHECK(m->shape() == Shape{a, b, c});
      CHECK(m->size() == w);
      CHECK(m->get_coordinate() == co);
      const std::vector<std::string> names{"a", "b", "c"};
      auto rank_at = [&](int64_t i, int64_t j, int64_t k) { return static_cast<int>(i * b * c + j * c + k); };
      for (int64_t i = 0; i < 3; ++i) {
        auto name = names[static_cast<size_t>(i)];
        CHECK(m->get_local_rank(i) == co[static_cast<size_t>(i)]);
        CHECK(m->get_local_rank(name) == co[static_cast<size_t>(i)]);
        CHECK(m->size(i) == m->shape()[static_cast<size_t>(i)]);
        CHECK(m->get_group(name) == m->get_group(i));
        CHECK(m->get_group(i)->size() == m->size(i));
        CHECK(m->get_group(i)->rank() == m->get_local_rank(i));
        // The group of dim i: the ranks that differ from me along dim i only, in coordinate order.
        std::vector<int> expect;
        for (int64_t v = 0; v < m->size(i); ++v) {
          auto q = co;
          q[static_cast<size_t>(i)] = v;
          expect.push_back(rank_at(q[0], q[1], q[2]));
        }
        CHECK(group_members(m->get_group(i)) == expect);
        auto one = (*m)[name];
        CHECK(one->ranks() == expect);
        CHECK(one->get_coordinate() == std::vector<int64_t>{co[static_cast<size_t>(i)]});
      }
      // mesh["a", "c"]: the 2-D submesh through my coordinate along b.
      auto ac = m->slice({"a", "c"});
      std::vector<int> ac_ranks;
      for (int64_t i = 0; i < a; ++i)
        for (int64_t k = 0; k < c; ++k) ac_ranks.push_back(rank_at(i, co[1], k));
      CHECK(ac->ndim() == 2);
      CHECK(ac->shape() == Shape{a, c});
      CHECK(ac->dim_names() == std::vector<std::string>{"a", "c"});
      CHECK(ac->ranks() == ac_ranks);
      CHECK(ac->size() == a * c);
      CHECK(ac->get_coordinate() == std::vector<int64_t>{co[0], co[2]});
      CHECK(ac->get_local_rank("c") == co[2]);
      CHECK(ac->get_group("a") == m->get_group("a"));
      CHECK(ac->get_group(1) == m->get_group("c"));
      CHECK(*m->slice({"a", "b", "c"}) == *m);
      CHECK_THROWS_WITH(m->slice({"c", "a"}), Catch::Contains("must follow the mesh's order"));
      CHECK_THROWS_WITH(m->slice({"a", "x"}), Catch::Contains("no dim named 'x'"));
      // Flattening a subset of dims: one new group over the submesh's ranks.
      auto flat = ac->flatten();
      CHECK(flat->ndim() == 1);
      CHECK(flat->dim_names() == std::vector<std::string>{"a_c"});
      CHECK(flat->size() == a * c);
      CHECK(flat->ranks() == ac_ranks);
      CHECK(flat->get_coordinate() == std::vector<int64_t>{co[0] * c + co[2]});
      CHECK(flat->get_local_rank(0) == flat->get_group(0)->rank());
      CHECK(group_members(flat->get_group(0)) == ac_ranks);
      auto bc = m->slice({"b", "c"})->flatten("bc");
      CHECK(bc->dim_names() == std::vector<std::string>{"bc"});
      CHECK(bc->get_coordinate() == std::vector<int64_t>{co[1] * c + co[2]});
      std::vector<int> bc_ranks;
      for (int64_t j = 0; j < b; ++j)
        for (int64_t k = 0; k < c; ++k) bc_ranks.push_back(rank_at(co[0], j, k));
      CHECK(group_members(bc->get_group(0)) == bc_ranks);
      // A named flattening is registered on the root: "bc" slices like one of
      // its dims, alone or with "a", in the mesh's order or any other.
      auto again = m->slice({"bc"});
      CHECK(again->ranks() == bc_ranks);
      CHECK(again->get_coordinate() == std::vector<int64_t>{co[1] * c + co[2]});
      CHECK(again->get_group(0) == bc->get_group(0));
      CHECK(m->slice({"b", "c"})->flatten("bc") == bc);  // the registered mesh, no new group
      auto a_bc = m->slice({"a", "bc"});
      std::vector<int> all(static_cast<size_t>(w));
      for (int i = 0; i < w; ++i) all[static_cast<size_t>(i)] = i;
      CHECK(a_bc->shape() == Shape{a, b * c});
      CHECK(a_bc->ranks() == all);
      CHECK(a_bc->get_coordinate() == std::vector<int64_t>{co[0], co[1] * c + co[2]});
      CHECK(a_bc->get_group("a") == m->get_group("a"));
      CHECK(a_bc->get_group("bc") == bc->get_group(0));
      CHECK(a_bc->root() == m);
      std::vector<int> bc_a;
      for (int64_t j = 0; j < b * c; ++j)
        for (int64_t i = 0; i < a; ++i) bc_a.push_back(rank_at(i, j / c, j % c));
      CHECK(m->slice({"bc", "a"}, /*any_order=*/true)->ranks() == bc_a);
      CHECK_THROWS_WITH(m->slice({"bc", "c"}, true), Catch::Contains("be distinct dims of the mesh"));
      CHECK_THROWS_WITH(m->slice({"a", "b"})->flatten("bc"), Catch::Contains("'bc' already names a flattening of other dims"));
      CHECK_THROWS_WITH(m->slice({"a", "c"})->flatten("b"), Catch::Contains("'b' is a dim of"));
      CHECK_THROWS_WITH(m->slice({"c", "a"}, true)->flatten("ca"), Catch::Contains("out of the order of"));
      // A DTensor on the flattened submesh: sharded over a*c ranks, replicated along b.
      Tensor full5 = ints({5, 3}, 17);
      Tensor on_flat = distribute_tensor_local(full5, flat, {Shard{0}});
      CHECK(equal(full_tensor(on_flat), full5));
      // Redistribute on the 3-D mesh: every pair of these, against pieces cut here.
      std::vector<Placements> cases{{Shard{0}, Shard{1}, Replicate{}}, {Shard{0}, Shard{0}, Shard{0}},
                                    {Replicate{}, Shard{1}, Shard{0}}, {Shard{1}, Replicate{}, Shard{1}},
                                    {Replicate{}, Replicate{}, Replicate{}}, {Shard{0}, Replicate{}, Shard{0}},
                                    {Shard{1}, Shard{1}, Shard{0}}};
      for (Shape shape : {Shape{5, 3}, Shape{2, 1}, Shape{0, 2}}) {
        Tensor full = ints(shape, 19);
        for (const auto& src : cases) {
          Tensor x = distribute_tensor(full, m, src);
          CHECK(equal(local_tensor(x), chunk_piece(full, *m, src)));
          for (const auto& dst : cases) {
            INFO(placements_str(src) << " -> " << placements_str(dst) << " on " << shape_str(shape));
            Tensor y = redistribute_local(x, dst);
            CHECK(equal(local_tensor(y), chunk_piece(full, *m, dst)));
          }
        }
        // A round trip through Partial placements: bit for bit with max/min (values
        // kept), to the rounding of x/k with sum and avg.
        std::vector<Placements> trip{{Shard{0}, Shard{1}, Replicate{}},
                                     {Partial{dist::ReduceOp::Max}, Shard{0}, Partial{dist::ReduceOp::Min}},
                                     {Shard{1}, Partial{dist::ReduceOp::Max}, Shard{0}},
                                     {Shard{0}, Shard{0}, Shard{0}},
                                     {Partial{}, Replicate{}, Partial{dist::ReduceOp::Avg}},
                                     {Shard{1}, Shard{0}, Shard{1}}};
        Tensor x = distribute_tensor(full, m, trip[0]);
        for (size_t s = 1; s < trip.size(); ++s) {
          INFO("round trip step " << placements_str(trip[s]));
          x = redistribute_local(x, trip[s]);
          if (s < 4) CHECK(equal(full_tensor(x), full));
          else CHECK_CLOSE(full_tensor(x), full, 1e-15, 1e-15);
        }
      }
    }
  }
  CHECK(meshes_tested == (w == 1 ? 1 : w == 4 ? 6 : 3));  // 4 ranks: 1x1x4, 1x2x2, 1x4x1, 2x1x2, 2x2x1, 4x1x1
}

TEST_CASE("distribute_tensor -> full_tensor is the identity, bit for bit", "[dtensor][distribute]") {
  for (auto& mesh : meshes()) {
    std::vector<Placements> cases;
    if (mesh->ndim() == 1) {
      cases = {{Shard{0}}, {Shard{1}}, {Replicate{}}, {Shard{-1}}};
    } else {
      cases = {{Shard{0}, Shard{0}}, {Shard{0}, Shard{1}}, {Replicate{}, Shard{0}},
               {Shard{1}, Replicate{}}, {Replicate{}, Replicate{}}, {Shard{1}, Shard{1}}};
    }
    for (Shape shape : {Shape{1, 3}, Shape{3, 1}, Shape{5, 4}, Shape{17, 3}, Shape{2, 17}, Shape{0, 3}}) {
      for (const auto& ps : cases) {
        INFO(mesh->str() << " " << placements_str(ps) << " " << shape_str(shape));
        Tensor full = ints(shape, 7);
        Tensor dt = distribute_tensor(full, mesh, ps);
        CHECK(dt.shape() == shape);
        auto [ls, off] = local_shape_and_offset(shape, *mesh, normalize_placements(ps, *mesh, 2, "t"),
                                                mesh->get_coordinate());
        CHECK(local_tensor(dt).shape() == ls);
        CHECK(equal(full_tensor(dt), full));
      }
    }
  }
  // The values of mesh rank 0 win.
  auto mesh = init_device_mesh("cpu", {world()});
  Tensor mine = full({4, 2}, static_cast<double>(dist::rank()), DType::F64);
  CHECK(equal(full_tensor(distribute_tensor(mine, mesh, {Shard{0}})), zeros({4, 2}, DType::F64)));
  CHECK_THROWS_WITH(distribute_tensor(mine, mesh, {Partial{}}), Catch::Contains("P(sum) is not allowed"));
  CHECK_THROWS_WITH(distribute_tensor(mine, mesh, {Shard{2}}), Catch::Contains("S(2) is out of range"));
}

TEST_CASE("every redistribute transition on 1-D meshes, uneven and empty shards", "[dtensor][redistribute]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"x"});
  for (Shape shape : {Shape{1, 1}, Shape{3, 2}, Shape{5, 17}, Shape{17, 5}, Shape{2, 3}, Shape{0, 3}, Shape{4, 0}}) {
    Tensor full = ints(shape, 11);
    for (const auto& src : all_1d()) {
      for (const auto& dst : all_1d()) {
        INFO(placement_str(src) << " -> " << placement_str(dst) << " on " << shape_str(shape));
        Tensor a = make_from_full(full, mesh, {src});
        Tensor b = redistribute_local(a, {dst});
        CHECK(placements_str(dtensor_spec(b).placements) == placements_str({dst}));
        if (is_partial(dst)) {
          CHECK_CLOSE(full_tensor(b), full, 1e-15, 1e-14);  // the partials sum to the value (x/k rounds)
        } else {
          CHECK(equal(local_tensor(b), local_tensor(distribute_tensor_local(full, mesh, {dst}))));
        }
        CHECK(equal(full_tensor(a), full));  // the source is untouched
      }
    }
  }
}

TEST_CASE("redistribute on 2-D meshes: all placement pairs", "[dtensor][redistribute]") {
  for (auto& mesh : meshes()) {
    if (mesh->ndim() != 2) continue;
    // {3, 2}, {1, 1}, {0, 3}: on 2x2 nested shards come out empty ((S0, S0) of 3 rows: 1, 1, 1, 0;
    // of 1 row: 1, 0, 0, 0; of 0 rows: none anywhere), as do S1 shards of 1 or 2 columns.
    for (Shape shape : {Shape{7, 5}, Shape{3, 2}, Shape{1, 1}, Shape{0, 3}}) {
    Tensor full = ints(shape, 13);
    for (const auto& s0 : all_1d())
      for (const auto& s1 : all_1d())
        for (const auto& d0 : all_1d())
          for (const auto& d1 : all_1d()) {
            Placements src{s0, s1}, dst{d0, d1};
            INFO(mesh->str() << " " << placements_str(src) << " -> " << placements_str(dst) << " on "
                             << shape_str(shape));
            Tensor a = make_from_full(full, mesh, src);
            Tensor b = redistribute_local(a, dst);
            if (is_partial(d0) || is_partial(d1)) {
              CHECK_CLOSE(full_tensor(b), full, 1e-15, 1e-14);
            } else {
              CHECK(equal(local_tensor(b), local_tensor(distribute_tensor_local(full, mesh, dst))));
            }
          }
    }
  }
}

namespace {
// The reduction of per-rank contributions, computed here on one rank.
Tensor reduce_ref(const std::vector<Tensor>& parts, dist::ReduceOp op) {
  Tensor acc = ops::clone(parts.at(0));
  for (size_t i = 1; i < parts.size(); ++i) {
    ops::BinaryOp b = op == dist::ReduceOp::Max   ? ops::BinaryOp::Maximum
                      : op == dist::ReduceOp::Min ? ops::BinaryOp::Minimum
                                                  : ops::BinaryOp::Add;
    acc = ops::binary(b, acc, parts[i]);
  }
  if (op == dist::ReduceOp::Avg) acc = ops::binary(ops::BinaryOp::Div, acc, static_cast<double>(parts.size()));
  return acc;
}

// Row-major coordinate of global rank `rank` on `mesh` (a mesh over the whole world).
std::vector<int64_t> coord_of(const DeviceMesh& mesh, int64_t rank) {
  std::vector<int64_t> c(static_cast<size_t>(mesh.ndim()));
  for (int64_t i = mesh.ndim(); i-- > 0;) {
    c[static_cast<size_t>(i)] = rank % mesh.size(i);
    rank /= mesh.size(i);
  }
  return c;
}

// What the rank at `coord` contributes to a tensor with Partial placements: an
// integer tensor that depends on the coordinates along the Partial mesh dims only
// (ranks that differ along a Shard or Replicate dim hold pieces of one tensor).
Tensor contribution(const Shape& shape, const Placements& ps, const std::vector<int64_t>& coord) {
  uint64_t seed = 500;
  for (size_t i = 0; i < ps.size(); ++i) seed = seed * 8 + (is_partial(ps[i]) ? static_cast<uint64_t>(coord[i]) : 0);
  return ints(shape, seed);
}

// The value a DTensor with placements `ps` built from `contribution` holds: the
// reduction over every combination of Partial coordinates (one op on all of them).
Tensor partial_value(const Shape& shape, const DeviceMesh& mesh, const Placements& ps, dist::ReduceOp op) {
  std::vector<Tensor> parts;
  for (int64_t r = 0; r < mesh.size(); ++r) {
    auto c = coord_of(mesh, r);
    bool first_of_its_set = true;  // each combination once: coordinate 0 on the other dims
    for (size_t i = 0; i < ps.size(); ++i)
      if (!is_partial(ps[i]) && c[i] != 0) first_of_its_set = false;
    if (first_of_its_set) parts.push_back(contribution(shape, ps, c));
  }
  return reduce_ref(parts, op);
}

// This rank's DTensor for `partial_value`: its contribution cut by the Shard dims.
Tensor make_partial(const Shape& shape, const MeshPtr& mesh, const Placements& ps) {
  Placements no_partial = ps;
  for (auto& p : no_partial)
    if (is_partial(p)) p = Replicate{};
  Tensor c = contribution(shape, ps, mesh->get_coordinate());
  return make_dtensor(ops::clone(local_tensor(distribute_tensor_local(c, mesh, no_partial))), mesh, ps, shape);
}

// Every rank's local tensor (all of the same shape), gathered over the world.
std::vector<Tensor> all_locals(const Tensor& local) {
  int w = dist::world_size();
  Shape s = local.shape();
  s.insert(s.begin(), w);
  Tensor out = empty(s, local.dtype());
  dist::world()->all_gather_into_tensor(ops::reshape(out, {out.numel()}), ops::reshape(ops::contiguous(local), {local.numel()}))->wait();
  std::vector<Tensor> v;
  for (int r = 0; r < w; ++r) v.push_back(ops::clone(ops::select(out, 0, r)));
  return v;
}

Placements with_op(Placements ps, dist::ReduceOp op) {
  for (auto& p : ps)
    if (is_partial(p)) p = Partial{op};
  return ps;
}

// Every placement tuple over {S(0), S(1), R, P(op)} for a mesh of `ndim` dims.
std::vector<Placements> all_tuples(int64_t ndim, dist::ReduceOp op) {
  std::vector<Placements> out{{}};
  for (int64_t i = 0; i < ndim; ++i) {
    std::vector<Placements> next;
    for (const auto& prefix : out)
      for (const auto& p : all_1d()) {
        Placements q = prefix;
        q.push_back(p);
        next.push_back(with_op(q, op));
      }
    out = next;
  }
  return out;
}
}  // namespace

TEST_CASE("Partial(sum|avg|max|min) through redistribute: values from the per-rank contributions",
          "[dtensor][redistribute][partial]") {
  int w = world();
  for (auto& mesh : meshes()) {
    // 1-D, and on 2-D meshes 2x2 (both dims reduce) plus the degenerate 1xW and Wx1.
    for (dist::ReduceOp op : kReduceOps) {
      bool exact = op != dist::ReduceOp::Avg;  // integer sums, maxima and minima are exact
      for (Shape shape : {Shape{5, 3}, Shape{1, 2}, Shape{0, 3}}) {
        for (const auto& src : all_tuples(mesh->ndim(), op)) {
          bool src_partial = std::any_of(src.begin(), src.end(), [](const Placement& p) { return is_partial(p); });
          Tensor value = partial_value(shape, *mesh, src, op);
          Tensor a = make_partial(shape, mesh, src);
          for (const auto& dst : all_tuples(mesh->ndim(), op)) {
            INFO(mesh->str() << " " << placements_str(src) << " -> " << placements_str(dst) << " on "
                             << shape_str(shape));
            bool dst_partial = std::any_of(dst.begin(), dst.end(), [](const Placement& p) { return is_partial(p); });
            if (!src_partial && !dst_partial) continue;  // the tests above cover those
            Tensor b = redistribute_local(a, dst);
            CHECK(dtensor_spec(b).placements == dst);
            if (!dst_partial) {
              // Partial -> Replicate / Shard: this rank holds its piece of the reduced value.
              Tensor expect = local_tensor(distribute_tensor_local(value, mesh, dst));
              if (exact) CHECK(equal(local_tensor(b), expect));
              else CHECK_CLOSE(local_tensor(b), expect, 1e-14, 1e-14);
              continue;
            }
            // The partial value is kept; where the target is R/P only (same local shape on
            // every rank) reduce the ranks' locals by hand, without redistribute.
            bool no_shard = std::none_of(dst.begin(), dst.end(), [](const Placement& p) { return is_shard(p); });
            if (no_shard) {
              auto locals = all_locals(local_tensor(b));
              std::vector<Tensor> mine;  // the ranks that share my coordinates on the non-Partial dims
              for (int r = 0; r < w; ++r) {
                auto c = coord_of(*mesh, r);
                bool same = true;
                for (size_t i = 0; i < dst.size(); ++i)
                  if (!is_partial(dst[i]) && c[i] != mesh->get_coordinate()[i]) same = false;
                if (same) mine.push_back(locals[static_cast<size_t>(r)]);
              }
              CHECK_CLOSE(reduce_ref(mine, op), value, 1e-14, 1e-14);
            }
            if (exact && op != dist::ReduceOp::Sum) CHECK(equal(full_tensor(b), value));
            else CHECK_CLOSE(full_tensor(b), value, 1e-14, 1e-14);
          }
        }
      }
    }
  }
  // Replicate -> Partial: sum splits the value (x/k on every rank), avg/max/min keep it.
  for (auto& mesh : meshes()) {
    for (dist::ReduceOp op : kReduceOps) {
      Tensor full = ints({5, 3}, 3);
      Placements src(static_cast<size_t>(mesh->ndim()), Replicate{});
      for (int64_t i = 0; i < mesh->ndim(); ++i) {
        Placements dst = src;
        dst[static_cast<size_t>(i)] = Partial{op};
        INFO(mesh->str() << " " << placements_str(src) << " -> " << placements_str(dst));
        Tensor b = redistribute_local(distribute_tensor_local(full, mesh, src), dst);
        double k = static_cast<double>(mesh->size(i));
        if (op == dist::ReduceOp::Sum) CHECK_CLOSE(local_tensor(b), ops::binary(ops::BinaryOp::Div, full, k), 1e-15, 0);
        else CHECK(equal(local_tensor(b), full));
      }
    }
  }
}

TEST_CASE("DTensor ops: elementwise, in-place, reductions, likes", "[dtensor][ops]") {
  for (auto& mesh : meshes()) {
    Placements ps = mesh->ndim() == 1 ? Placements{Shard{0}} : Placements{Replicate{}, Shard{0}};
    Tensor fa = ints({17, 3}, 1), fb = ints({17, 3}, 2);
    Tensor a = distribute_tensor_local(fa, mesh, ps), b = distribute_tensor_local(fb, mesh, ps);
    CHECK(equal(full_tensor(ops::add(a, b)), ops::add(fa, fb)));
    CHECK(equal(full_tensor(ops::mul(a, 2.5)), ops::mul(fa, 2.5)));
    CHECK(equal(full_tensor(ops::exp(ops::mul(a, 0.1))), ops::exp(ops::mul(fa, 0.1))));
    CHECK(equal(full_tensor(tessera::mul(a, b)), ops::mul(fa, fb)));  // through autograd's layer too
    // Different placements: the second operand is redistributed to the first's.
    Tensor br = distribute_tensor_local(fb, mesh, Placements(ps.size(), Replicate{}));
    CHECK(equal(full_tensor(ops::sub(a, br)), ops::sub(fa, fb)));
    // In-place optimizer ops run on local shards.
    Tensor p = distribute_tensor_local(fa, mesh, ps), m = zeros_like(p);
    CHECK(dtensor_spec(m).placements == dtensor_spec(p).placements);
    ops::lerp_(m, b, 0.5);
    ops::addcmul_(p, b, b, 0.25);
    ops::add_(p, 1.0);
    ops::mul_(p, 2.0);
    Tensor expect = ops::mul(ops::add(ops::add(fa, ops::mul(ops::mul(fb, fb), 0.25)), 1.0), 2.0);
    CHECK(equal(full_tensor(p), expect));
    CHECK(equal(full_tensor(m), ops::mul(fb, 0.5)));
    CHECK_THROWS_WITH(ops::add_(p, br), Catch::Contains("need equal specs"));
    CHECK_THROWS_WITH(ops::add_(p, fb), Catch::Contains("plain tensor"));
    // Sums: a sharded dim reduced becomes Partial(sum), then reduced on full_tensor().
    Tensor s = ops::sum(a);
    bool sharded = mesh->size(mesh->ndim() - 1) > 1 || mesh->ndim() == 1;
    if (sharded && world() > 1) CHECK(is_partial(dtensor_spec(s).placements.back()));
    CHECK(full_tensor(s).item() == ops::sum(fa).item());
    Tensor s1 = ops::sum(a, {1});
    CHECK(is_shard(dtensor_spec(s1).placements.back(), 0));
    CHECK(equal(full_tensor(s1), ops::sum(fa, {1})));
    CHECK(full_tensor(ops::mean(a)).item() == Approx(ops::mean(fa).item()).epsilon(1e-12));
    CHECK(equal(full_tensor(ops::to(a, DType::F32)), ops::to(fa, DType::F32)));
    CHECK_THROWS_WITH(ops::sum_squares(a), Catch::Contains("this rank's part only"));
    CHECK_CLOSE(full_tensor(ops::softmax(a, 0)), ops::softmax(fa, 0), 1e-15, 0);  // gathered dim 0 if split
    CHECK_THROWS_WITH(ops::cat({a, a}, 0), Catch::Contains("cat: no sharding rule for DTensors"));
  }
}

TEST_CASE("tensor-parallel Linear sharding rules", "[dtensor][linear]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"tp"});
  Tensor x = randn({3, 4, 8}, 1, DType::F64), w = randn({6, 8}, 2, DType::F64), bias = randn({6}, 3, DType::F64);
  Tensor ref = ops::linear(x, w, bias);
  // Column-wise: Replicate input x Shard(0) weight -> Shard(-1) output.
  Tensor xr = distribute_tensor_local(x, mesh, {Replicate{}});
  Tensor col = ops::linear(xr, distribute_tensor_local(w, mesh, {Shard{0}}),
                           distribute_tensor_local(bias, mesh, {Shard{0}}));
  CHECK(is_shard(dtensor_spec(col).placements[0], 2));
  CHECK(testing::allclose(full_tensor(col), ref, 1e-12, 1e-12));
  // Row-wise: Shard(-1) input x Shard(1) weight -> Partial output (bias added once).
  Tensor xs = distribute_tensor_local(x, mesh, {Shard{-1}});
  Tensor row = ops::linear(xs, distribute_tensor_local(w, mesh, {Shard{1}}),
                           distribute_tensor_local(bias, mesh, {Replicate{}}));
  if (world() > 1) CHECK(is_partial(dtensor_spec(row).placements[0]));
  CHECK(testing::allclose(full_tensor(row), ref, 1e-12, 1e-12));
  // matmul(a [.., k], b [k, n]) with the same two rules.
  Tensor wt = ops::contiguous(ops::transpose(w, 0, 1));
  Tensor mm_col = ops::matmul(xr, distribute_tensor_local(wt, mesh, {Shard{1}}));
  Tensor mm_row = ops::matmul(xs, distribute_tensor_local(wt, mesh, {Shard{0}}));
  Tensor mref = ops::matmul(x, wt);
  CHECK(testing::allclose(full_tensor(mm_col), mref, 1e-12, 1e-12));
  CHECK(testing::allclose(full_tensor(mm_row), mref, 1e-12, 1e-12));
  // The column -> row MLP pattern: Shard(-1) output of one feeds the next directly.
  Tensor w2 = randn({5, 6}, 4, DType::F64);
  Tensor mlp = ops::linear(col, distribute_tensor_local(w2, mesh, {Shard{1}}));
  CHECK(testing::allclose(full_tensor(mlp), ops::linear(ref, w2), 1e-12, 1e-12));
  if (world() > 1)
    CHECK_THROWS_WITH(ops::linear(xs, distribute_tensor_local(w, mesh, {Shard{0}})),
                      Catch::Contains("no sharding rule"));
}

TEST_CASE("sharded random init equals the full init sliced, on any mesh", "[dtensor][random]") {
  for (auto& mesh : meshes()) {
    std::vector<Placements> cases = mesh->ndim() == 1
                                        ? std::vector<Placements>{{Shard{0}}, {Shard{1}}, {Replicate{}}}
                                        : std::vector<Placements>{{Replicate{}, Shard{0}}, {Shard{0}, Shard{1}},
                                                                  {Shard{1}, Shard{1}}, {Shard{0}, Shard{0}}};
    for (const auto& ps : cases) {
      INFO(mesh->str() << " " << placements_str(ps));
      Tensor full = empty({17, 9});
      ops::normal_(full, 0.0, 0.02, {99, 5, 0, {}});
      Tensor dt = distribute_tensor_local(zeros({17, 9}), mesh, ps);
      ops::normal_(dt, 0.0, 0.02, {99, 5, 0, {}});
      CHECK(equal(local_tensor(dt), local_tensor(distribute_tensor_local(full, mesh, ps))));
    }
  }
}

TEST_CASE("gradient norm and clipping over sharded gradients: one all-reduce", "[dtensor][clip]") {
  for (auto& mesh : meshes()) {
    Placements ps = mesh->ndim() == 1 ? Placements{Shard{0}} : Placements{Replicate{}, Shard{0}};
    Tensor ga = randn({17, 3}, 31, DType::F64), gb = randn({5}, 32, DType::F64), gc = randn({2, 2}, 33, DType::F64);
    Tensor a = distribute_tensor_local(zeros({17, 3}, DType::F64), mesh, ps);
    Tensor b = distribute_tensor_local(zeros({5}, DType::F64), mesh, Placements(ps.size(), Replicate{}));
    Tensor c = zeros({2, 2}, DType::F64);  // a plain (replicated, unsharded) parameter
    for (Tensor* t : {&a, &b, &c}) t->set_requires_grad(true);
    a.set_grad(distribute_tensor_local(ga, mesh, ps));
    b.set_grad(distribute_tensor_local(gb, mesh, Placements(ps.size(), Replicate{})));
    c.set_grad(gc);
    double expect = std::sqrt(ops::sum_squares(ga) + ops::sum_squares(gb) + ops::sum_squares(gc));
    auto world_group = mesh->flat_group();
    int64_t before = world_group->stats().all_reduce;
    double norm = nn::clip_grad_norm_({a, b, c}, 0.5).item();
    CHECK(norm == Approx(expect).epsilon(1e-12));
    CHECK(world_group->stats().all_reduce - before == 1);  // one, whatever the number of parameters
    CHECK(nn::grad_norm({a, b, c}).item() == Approx(0.5).epsilon(1e-6));
    CHECK(testing::allclose(full_tensor(a.grad()), ops::mul(ga, 0.5 / (expect + 1e-6)), 1e-12, 1e-14));
  }
}

TEST_CASE("softmax, attention and RoPE on split DTensors: each rank its own rows and heads", "[dtensor][pershard]") {
  // [B, H, T, D] = [3, 4, 5, 6]: the batch uneven from 2 ranks on (an empty
  // shard at 4), the heads even at 2 and 4, uneven at 3.
  const int64_t B = 3, H = 4, Hkv = 2, T = 5, D = 6;
  Tensor q = randn({B, H, T, D}, 1, DType::F64), k = randn({B, Hkv, T, D}, 2, DType::F64);
  Tensor v = randn({B, Hkv, T, D}, 3, DType::F64), dout = randn({B, H, T, D}, 4, DType::F64);
  Tensor cos = randn({T, D / 2}, 5, DType::F64), sin = randn({T, D / 2}, 6, DType::F64);
  const double scale = 0.4;
  auto want = ops::attention(q, k, v, true, scale);
  auto want_g = ops::attention_backward(dout, q, k, v, want.out, want.lse, true, scale);
  for (const MeshPtr& mesh : meshes()) {
    for (int64_t split : {0, 1, 2, 3}) {
      Placements ps(static_cast<size_t>(mesh->ndim()), Replicate{});
      ps.back() = Shard{split};
      INFO(mesh->str() << " " << placements_str(ps));
      const int64_t n = mesh->size(mesh->ndim() - 1);
      // softmax over the last dim keeps any other split; over a split dim it gathers first.
      for (int64_t dim : {3, 2}) {
        Tensor x = distribute_tensor(q, mesh, ps);
        Tensor y = ops::softmax(x, dim);
        CHECK_CLOSE(full_tensor(y), ops::softmax(q, dim), 1e-15, 0);
        CHECK(dtensor_spec(y).placements.back() == (split == dim ? Placement{Replicate{}} : Placement{Shard{split}}));
        Tensor g = ops::softmax_backward(distribute_tensor(dout, mesh, ps), y, dim);
        CHECK_CLOSE(full_tensor(g), ops::softmax_backward(dout, ops::softmax(q, dim), dim), 1e-15, 0);
        CHECK_CLOSE(full_tensor(ops::log_softmax(x, dim)), ops::log_softmax(q, dim), 1e-15, 0);
      }
      // RoPE: any split before [T, D]; a split sequence is gathered (its angles are by position).
      Tensor r = ops::rope(distribute_tensor(q, mesh, ps), cos, sin);
      CHECK_CLOSE(full_tensor(r), ops::rope(q, cos, sin), 1e-15, 0);
      CHECK(is_shard(dtensor_spec(r).placements.back()) == (split < 2));
      // Attention: batch and heads; query and key/value heads must split alike (evenly).
      Tensor dq = distribute_tensor(q, mesh, ps), dk = distribute_tensor(k, mesh, ps);
      Tensor dv = distribute_tensor(v, mesh, ps);
      if (split == 1 && (H % n != 0 || Hkv % n != 0)) {
        CHECK_THROWS_WITH(ops::attention(dq, dk, dv, true, scale), Catch::Contains("do not both divide evenly"));
        continue;
      }
      auto got = ops::attention(dq, dk, dv, true, scale);
      CHECK_CLOSE(full_tensor(got.out), want.out, 1e-14, 1e-15);
      CHECK_CLOSE(full_tensor(got.lse), want.lse, 1e-14, 1e-15);
      CHECK(is_shard(dtensor_spec(got.out).placements.back()) == (split < 2));
      auto g = ops::attention_backward(distribute_tensor(dout, mesh, ps), dq, dk, dv, got.out, got.lse, true, scale);
      CHECK_CLOSE(full_tensor(g.dq), want_g.dq, 1e-13, 1e-14);
      CHECK_CLOSE(full_tensor(g.dk), want_g.dk, 1e-13, 1e-14);
      CHECK_CLOSE(full_tensor(g.dv), want_g.dv, 1e-13, 1e-14);
      CHECK(dtensor_spec(g.dk).global_shape == k.shape());
    }
  }
}

TEST_CASE("reshape and transpose of split DTensors: heads out of features and back", "[dtensor][views]") {
  // [B, T, C] with C = H * D: a column-wise projection's output, split on C.
  const int64_t B = 2, T = 5, H = 4, D = 3, C = H * D;
  Tensor x = randn({B, T, C}, 7, DType::F64);
  for (const MeshPtr& mesh : meshes()) {
    const int64_t n = mesh->size(mesh->ndim() - 1);
    Placements ps(static_cast<size_t>(mesh->ndim()), Replicate{});
    ps.back() = Shard{2};
    INFO(mesh->str());
    Tensor dx = distribute_tensor(x, mesh, ps);
    // Whole heads on every rank iff C's chunks are whole multiples of D at H's chunk borders.
    bool whole_heads = true;
    for (int64_t r = 0; r < n; ++r)
      whole_heads = whole_heads && shard_size_and_offset(C, n, r).first == D * shard_size_and_offset(H, n, r).first;
    if (!whole_heads) {
      CHECK_THROWS_WITH(ops::reshape(dx, {B, T, H, D}), Catch::Contains("not whole rows of the new dim 2"));
      continue;
    }
    Tensor heads = ops::reshape(dx, {B, T, H, D});
    CHECK(dtensor_spec(heads).placements.back() == Placement{Shard{2}});
    Tensor bhtd = ops::transpose(heads, 1, 2);
    CHECK(dtensor_spec(bhtd).placements.back() == Placement{Shard{1}});
    CHECK(bhtd.shape() == Shape{B, H, T, D});
    CHECK(equal(full_tensor(bhtd), ops::transpose(ops::reshape(x, {B, T, H, D}), 1, 2)));
    // Back: [B, H, T, D] -> [B, T, H, D] -> [B, T, C], split on C again.
    Tensor back = ops::reshape(ops::contiguous(ops::transpose(bhtd, 1, 2)), {B, T, C});
    CHECK(dtensor_spec(back).placements.back() == Placement{Shard{2}});
    CHECK(equal(full_tensor(back), x));
    // Merging the split dim with the one after keeps the split on the merged dim.
    Tensor flat = ops::reshape(heads, {B * T, C});
    CHECK(dtensor_spec(flat).placements.back() == Placement{Shard{1}});
    CHECK(equal(full_tensor(flat), ops::reshape(x, {B * T, C})));
    // A Partial sum reshapes as it is (the view is linear).
    Placements pp(static_cast<size_t>(mesh->ndim()), Replicate{});
    pp.back() = Partial{};
    Tensor partial = ops::reshape(make_from_full(ints({B, T, C}, 9), mesh, pp), {B, T, H, D});
    CHECK(is_partial(dtensor_spec(partial).placements.back()));
    CHECK(equal(full_tensor(partial), ops::reshape(ints({B, T, C}, 9), {B, T, H, D})));
    // A split dim that is not the outermost of what it becomes is refused, on every rank.
    Placements p0(static_cast<size_t>(mesh->ndim()), Replicate{});
    p0.back() = Shard{1};
    Tensor odd = distribute_tensor(randn({6, 4}, 3, DType::F64), mesh, p0);
    CHECK_THROWS_WITH(ops::reshape(odd, {4, 6}), Catch::Contains("would not be the outermost"));
    CHECK_THROWS_WITH(ops::reshape(dx, {B, T * C}), Catch::Contains("would not be the outermost"));
  }
}

TEST_CASE("ops without a sharding rule refuse a DTensor, naming the op and its placements", "[dtensor][errors]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"tp"});
  Tensor d = distribute_tensor(randn({2, 4, 6}, 1, DType::F64), mesh, {Shard{1}});
  const std::string spec = "placements (S(1)), global [2, 4, 6]";
  CHECK_THROWS_WITH(ops::cat({d, d}, 0), Catch::Contains("cat: no sharding rule") && Catch::Contains(spec));
  CHECK_THROWS_WITH(ops::stack({d, d}, 0), Catch::Contains("stack: no sharding rule") && Catch::Contains(spec));
  CHECK_THROWS_WITH(ops::max(d, 1), Catch::Contains("max: no sharding rule") && Catch::Contains(spec));
  CHECK_THROWS_WITH(ops::max(d), Catch::Contains("max: no sharding rule"));
  CHECK_THROWS_WITH(ops::argmax(d, 2), Catch::Contains("argmax: no sharding rule"));
  CHECK_THROWS_WITH(ops::var(d, {1}), Catch::Contains("var: no sharding rule"));
  CHECK_THROWS_WITH(ops::narrow(d, 1, 0, 2), Catch::Contains("narrow: no sharding rule") && Catch::Contains(spec));
  CHECK_THROWS_WITH(ops::unsqueeze(d, 0), Catch::Contains("unsqueeze: no sharding rule"));
  CHECK_THROWS_WITH(ops::expand(d, {2, 4, 6}), Catch::Contains("expand: no sharding rule"));
}

TEST_CASE("every op a DTensor can reach has a sharding rule or a refusal", "[dtensor][rules]") {
  detail::register_sharding_rules();
  for (int i = 0; i < kNumOps; ++i) {
    const OpId op = static_cast<OpId>(i);
    INFO(op_name(op));
    if (op_family(op) == OpFamily::Kernel) CHECK(detail::rule_for(op) == nullptr);
    else CHECK(detail::rule_for(op) != nullptr);
  }
}
