// DeviceMesh, placements, redistribute and DTensor ops, under mpirun with
// 1-4 ranks. Every rank knows the full tensors (built from seeds), so each
// checks its own local piece exactly.
#include <cmath>

#include "autograd/functions.h"
#include "dtensor/redistribute.h"
#include "nn/optim.h"
#include "tests/helpers.h"

using namespace tessera;
using testing::equal;

namespace {

int world() {
  dist::init();
  return dist::world_size();
}

// Integer-valued f64 data: every sum and gather is exact, so checks are bitwise.
Tensor ints(const Shape& s, uint64_t seed) {
  return ops::to(randint(s, -9, 10, seed), DType::F64);
}

// The meshes to test at this world size: 1-D, and every 2-D factorisation.
std::vector<MeshPtr> meshes() {
  int w = world();
  std::vector<MeshPtr> out{init_device_mesh("cpu", {w}, {"dp"})};
  for (int a = 1; a <= w; ++a)
    if (w % a == 0) out.push_back(init_device_mesh("cpu", {a, w / a}, {"rep", "shard"}));
  return out;
}

Tensor full_like_value(const Tensor& t, double v) { return full(t.shape(), v, t.dtype(), t.device()); }

std::vector<Placement> all_1d() { return {Shard{0}, Shard{1}, Replicate{}, Partial{}}; }

// A DTensor holding `full` with placements (Partial: rank contributions that sum to full).
Tensor make_from_full(const Tensor& full, const MeshPtr& mesh, const Placements& ps) {
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

}  // namespace


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
  CHECK_THROWS_WITH(init_device_mesh("cuda", {w}), Catch::Contains("not available in this build"));
  CHECK_THROWS_WITH(init_device_mesh("cpu", {w, 1}, {"a", "a"}), Catch::Contains("must be unique"));
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
  for (Shape shape : {Shape{1, 1}, Shape{3, 2}, Shape{5, 17}, Shape{17, 5}, Shape{2, 3}}) {
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
    Tensor full = ints({7, 5}, 13);
    for (const auto& s0 : all_1d())
      for (const auto& s1 : all_1d())
        for (const auto& d0 : all_1d())
          for (const auto& d1 : all_1d()) {
            Placements src{s0, s1}, dst{d0, d1};
            INFO(mesh->str() << " " << placements_str(src) << " -> " << placements_str(dst));
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

namespace {
// Central differences of a collective scalar function of a leaf x that every
// rank holds, against x's gradient: this rank's x.grad when every rank used
// all of x (Replicate), the sum over ranks when each used its shard or its
// partial share (Shard, Partial).
void check_cross_rank_grad(const std::function<double(const Tensor&, bool backward)>& loss, const Tensor& x0,
                           bool sum_over_ranks) {
  Tensor x = ops::clone(x0);
  x.set_requires_grad(true);
  loss(x, true);
  Tensor g = ops::clone(x.grad());
  if (sum_over_ranks) dist::world()->all_reduce(g)->wait();
  auto gv = g.to_vector<double>();
  double* p = x.data<double>();
  for (int64_t e = 0; e < x.numel(); ++e) {
    double orig = p[e], eps = 1e-6;
    autograd::NoGradGuard ng;
    p[e] = orig + eps;
    double up = loss(x, false);
    p[e] = orig - eps;
    double down = loss(x, false);
    p[e] = orig;
    CHECK(gv[static_cast<size_t>(e)] == Approx((up - down) / (2 * eps)).epsilon(1e-6).margin(1e-8));
  }
}

// Sum over ranks of a per-rank scalar.
double global_sum(const Tensor& local_loss) {
  Tensor t = ops::reshape(ops::clone(detach(local_loss)), {1});
  dist::world()->all_reduce(t)->wait();
  return t.item();
}
}  // namespace

TEST_CASE("gradients through redistribute, from_local, to_local, full_tensor", "[dtensor][autograd]") {
  auto mesh = init_device_mesh("cpu", {world()}, {"x"});
  int k = world(), r = dist::rank();
  Tensor x0 = randn({5, 3}, 21, DType::F64), w = randn({5, 3}, 22, DType::F64);
  auto piece = [&](const Tensor& x, int64_t d) {  // differentiable cut of x to this rank's shard
    auto [len, start] = shard_size_and_offset(x.size(d), k, r);
    return narrow(x, d, start, len);
  };
  auto weight_piece = [&](const Placement& p) {
    return is_shard(p) ? local_tensor(distribute_tensor_local(w, mesh, {p})) : w;
  };
  // y = redistribute(src -> dst); a replicated y gives every rank the same loss
  // sum(y * w); a sharded y gives each rank its part, and the loss is their sum.
  for (const auto& src : all_1d()) {
    for (const auto& dst : all_1d()) {
      if (is_partial(dst) || (is_shard(src) && is_partial(dst))) continue;
      INFO(placement_str(src) << " -> " << placement_str(dst));
      check_cross_rank_grad(
          [&](const Tensor& x, bool run_backward) {
            Tensor local = is_shard(src) ? piece(x, shard_dim(src))
                           : is_partial(src) ? x * (r == 0 ? 1.0 - 0.25 * (k - 1) : 0.25)
                                              : x;
            Tensor dt = from_local(local, mesh, {src}, Shape{5, 3});
            Tensor y = to_local(redistribute(dt, {dst}));
            Tensor l = sum(y * weight_piece(dst));
            if (run_backward) autograd::backward(l);
            return is_replicate(dst) ? l.item() : global_sum(l);
          },
          x0, !is_replicate(src));
    }
  }
  // full_tensor: every rank computes the same loss from the gathered tensor.
  check_cross_rank_grad(
      [&](const Tensor& x, bool run_backward) {
        Tensor y = full_tensor(from_local(piece(x, 0), mesh, {Shard{0}}, Shape{5, 3}));
        Tensor l = sum(y * w);
        if (run_backward) autograd::backward(l);
        return l.item();
      },
      x0, true);
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
    CHECK_THROWS_WITH(ops::softmax(a, 0), Catch::Contains("DTensor"));
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
    double norm = nn::clip_grad_norm_({a, b, c}, 0.5);
    CHECK(norm == Approx(expect).epsilon(1e-12));
    CHECK(world_group->stats().all_reduce - before == 1);  // one, whatever the number of parameters
    CHECK(nn::grad_norm({a, b, c}) == Approx(0.5).epsilon(1e-6));
    CHECK(testing::allclose(full_tensor(a.grad()), ops::mul(ga, 0.5 / (expect + 1e-6)), 1e-12, 1e-14));
  }
}
