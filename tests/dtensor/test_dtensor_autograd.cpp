// Autograd through DTensor: redistribute, from_local, to_local and
// full_tensor, with backward placements derived from the forward ones, checked
// against central differences of the global function across ranks (1-4 ranks,
// 1-D and 2-D meshes).
#include <cmath>
#include <functional>

#include "autograd/functions.h"
#include "tests/dtensor/dtensor_helpers.h"

using namespace tessera;
using namespace tessera::testing;

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

namespace {
// Differentiable: this rank's local piece of a global x that every rank holds:
// x cut along each Shard dim in mesh order; along a Partial dim, coordinate 0
// takes 1 - (k-1)/4 of it and the others 1/4 each (the partials sum to x).
Tensor local_piece(const Tensor& x, const MeshPtr& mesh, const Placements& ps) {
  Tensor t = x;
  for (size_t i = 0; i < ps.size(); ++i) {
    auto idx = static_cast<int64_t>(i);
    int64_t k = mesh->size(idx), c = mesh->get_local_rank(idx);
    if (is_shard(ps[i])) {
      int64_t d = shard_dim(ps[i]);
      auto [len, start] = shard_size_and_offset(t.size(d), k, c);
      t = narrow(t, d, start, len);
    } else if (is_partial(ps[i])) {
      t = t * (c == 0 ? 1.0 - 0.25 * static_cast<double>(k - 1) : 0.25);
    }
  }
  return t;
}

// d(local_piece(x))/dx summed over the piece: the share of the global gradient
// that this rank's x.grad must hold (1 on the rows it holds whole or as a
// replica, its partial weight, 0 where another rank holds the shard).
Tensor piece_mask(const Tensor& x0, const MeshPtr& mesh, const Placements& ps) {
  Tensor x = zeros(x0.shape(), x0.dtype());
  x.set_requires_grad(true);
  autograd::backward(sum(local_piece(x, mesh, ps)));
  return ops::clone(x.grad());
}

// Central differences of the global loss (the same number on every rank, each
// rank's x perturbed alike) against this rank's x.grad, which must be its
// share (mask) of the global gradient: a per-rank check, no sum over ranks.
void check_global_grad(const std::function<double(const Tensor&, bool backward)>& loss, const Tensor& x0,
                       const Tensor& mask) {
  Tensor x = ops::clone(x0);
  x.set_requires_grad(true);
  loss(x, true);
  REQUIRE(x.grad().defined());
  auto gv = x.grad().to_vector<double>(), mv = mask.to_vector<double>();
  double* p = x.data<double>();
  for (int64_t e = 0; e < x.numel(); ++e) {
    double orig = p[e], eps = 1e-6;
    autograd::NoGradGuard ng;
    p[e] = orig + eps;
    double up = loss(x, false);
    p[e] = orig - eps;
    double down = loss(x, false);
    p[e] = orig;
    auto i = static_cast<size_t>(e);
    INFO("element " << e);
    CHECK(gv[i] == Approx(mv[i] * (up - down) / (2 * eps)).epsilon(1e-6).margin(1e-8));
  }
}

// Replicate -> Partial(sum): the gradient placements of a to_local whose ranks
// compute different losses from the same value: the global gradient is the sum
// of theirs. Shards stay shards.
Placements partial_grads(Placements ps) {
  for (auto& p : ps)
    if (is_replicate(p)) p = Partial{};
  return ps;
}

// Per-rank random weights for the per-rank losses.
Tensor rank_weights(const Shape& s, uint64_t salt) {
  return randn(s, 1000 + 16 * salt + static_cast<uint64_t>(dist::rank()), DType::F64);
}
}  // namespace

TEST_CASE("gradients with per-rank upstream gradients: Shard -> Replicate backward is Partial -> Shard",
          "[dtensor][autograd]") {
  Tensor x0 = randn({5, 3}, 41, DType::F64);
  for (auto& mesh : meshes()) {
    std::vector<Placements> srcs, dsts;
    if (mesh->ndim() == 1) {
      srcs = {{Shard{0}}, {Shard{1}}, {Replicate{}}, {Partial{}}};
      dsts = {{Replicate{}}, {Shard{0}}, {Shard{1}}};
    } else {
      srcs = {{Shard{0}, Shard{1}}, {Shard{0}, Shard{0}}, {Replicate{}, Shard{0}}, {Shard{1}, Replicate{}},
              {Partial{}, Shard{0}}, {Shard{1}, Partial{}}, {Replicate{}, Replicate{}}, {Partial{}, Partial{}}};
      dsts = {{Replicate{}, Replicate{}}, {Shard{0}, Replicate{}}, {Replicate{}, Shard{1}},
              {Shard{1}, Shard{0}}, {Shard{0}, Shard{0}}};
    }
    for (const auto& src : srcs) {
      Tensor mask = piece_mask(x0, mesh, src);
      for (const auto& dst : dsts) {
        INFO(mesh->str() << " " << placements_str(src) << " -> " << placements_str(dst));
        // Each rank: loss_r = sum(y_r^2 * w_r) with its own random w_r over its local y_r;
        // the global loss is their sum, so y's gradient is Partial where y is replicated.
        Shape yshape = local_shape_and_offset(x0.shape(), *mesh, dst, mesh->get_coordinate()).first;
        Tensor wr = rank_weights(yshape, 1);
        check_global_grad(
            [&](const Tensor& x, bool run_backward) {
              Tensor dt = from_local(local_piece(x, mesh, src), mesh, src, x0.shape());
              Tensor y = to_local(redistribute(dt, dst), partial_grads(dst));
              Tensor l = sum(y * y * wr);
              if (run_backward) autograd::backward(l);
              return global_sum(l);
            },
            x0, mask);
      }
    }
    // full_tensor with grad_placements, and the collective the backward issues:
    // Shard(0) -> Replicate forward all-gathers, its backward reduce-scatters.
    Placements shard_all(static_cast<size_t>(mesh->ndim()), Shard{0});
    Placements partial_all(static_cast<size_t>(mesh->ndim()), Partial{});
    Tensor wr = rank_weights(x0.shape(), 2);
    check_global_grad(
        [&](const Tensor& x, bool run_backward) {
          Tensor y = full_tensor(from_local(local_piece(x, mesh, shard_all), mesh, shard_all, x0.shape()),
                                 partial_all);
          Tensor l = sum(y * y * wr);
          if (run_backward) {
            std::vector<dist::CollectiveStats> before;
            for (int64_t i = 0; i < mesh->ndim(); ++i) before.push_back(mesh->get_group(i)->stats());
            autograd::backward(l);
            for (int64_t i = 0; i < mesh->ndim(); ++i) {
              auto now = mesh->get_group(i)->stats();
              auto was = before[static_cast<size_t>(i)];
              CHECK(now.reduce_scatter - was.reduce_scatter == (mesh->size(i) > 1 ? 1 : 0));
              CHECK(now.total() - was.total() == now.reduce_scatter - was.reduce_scatter);
            }
          }
          return global_sum(l);
        },
        x0, piece_mask(x0, mesh, shard_all));
  }
}

TEST_CASE("gradients through Replicate -> Partial and Partial -> Replicate / Shard", "[dtensor][autograd]") {
  Tensor x0 = randn({5, 3}, 42, DType::F64), w = randn({5, 3}, 43, DType::F64);
  for (auto& mesh : meshes()) {
    Placements rep(static_cast<size_t>(mesh->ndim()), Replicate{});
    Tensor ones_mask = ones(x0.shape(), DType::F64);  // x is replicated: every rank holds the whole gradient
    for (dist::ReduceOp op : kReduceOps) {
      for (int64_t i = 0; i < mesh->ndim(); ++i) {
        Placements mid = rep, to_shard = rep;
        mid[static_cast<size_t>(i)] = Partial{op};
        to_shard[static_cast<size_t>(i)] = Shard{0};
        for (const auto& dst : {rep, to_shard}) {
          INFO(mesh->str() << " R -> " << placements_str(mid) << " -> " << placements_str(dst));
          Shape yshape = local_shape_and_offset(x0.shape(), *mesh, dst, mesh->get_coordinate()).first;
          Tensor wr = rank_weights(yshape, 3);
          check_global_grad(
              [&](const Tensor& x, bool run_backward) {
                Tensor p = redistribute(from_local(x, mesh, rep), mid);
                Tensor y = to_local(redistribute(p, dst), partial_grads(dst));
                Tensor l = sum(y * y * wr);
                if (run_backward) autograd::backward(l);
                return global_sum(l);
              },
              x0, ones_mask);
        }
      }
    }
    // to_local of the Partial(sum) itself: the sum(y_r * w) of the ranks along the
    // Partial dim add up to sum(x * w), whose gradient w is the same on every rank:
    // grad_placements R.
    Placements mid = rep;
    mid.back() = Partial{};
    INFO(mesh->str() << " to_local of R -> " << placements_str(mid));
    check_global_grad(
        [&](const Tensor& x, bool run_backward) {
          Tensor y = to_local(redistribute(from_local(x, mesh, rep), mid), rep);
          Tensor l = sum(y * w);
          if (run_backward) autograd::backward(l);
          Tensor t = ops::reshape(ops::clone(detach(l)), {1});
          mesh->get_group(-1)->all_reduce(t)->wait();
          return t.item();
        },
        x0, ones_mask);
  }
}

TEST_CASE("swiglu on split features: each rank's gate and up, its gradients laid out as they are",
          "[dtensor][autograd][swiglu]") {
  const int64_t w = world();
  MeshPtr mesh = init_device_mesh("cpu", {w}, {"tp"});
  // 7 features: uneven pieces at 2-4 ranks, none on some.
  Tensor gate0 = randn({3, 7}, 5, DType::F64), up0 = randn({3, 7}, 6, DType::F64), g0 = randn({3, 7}, 7, DType::F64);
  Tensor gate = distribute_tensor(gate0, mesh, {Shard{1}}), up = distribute_tensor(up0, mesh, {Shard{1}});
  gate.set_requires_grad(true), up.set_requires_grad(true);
  Tensor y = swiglu(gate, up);
  REQUIRE(dtensor_spec(y).placements == Placements{Shard{1}});
  autograd::backward(y, distribute_tensor(g0, mesh, {Shard{1}}));
  // The same on whole tensors, on every rank.
  Tensor wg = ops::clone(gate0), wu = ops::clone(up0);
  wg.set_requires_grad(true), wu.set_requires_grad(true);
  Tensor wy = swiglu(wg, wu);
  autograd::backward(wy, g0);
  CHECK(equal(full_tensor(y), wy));
  CHECK(dtensor_spec(gate.grad()).placements == Placements{Shard{1}});
  CHECK(equal(full_tensor(gate.grad()), wg.grad()));
  CHECK(equal(full_tensor(up.grad()), wu.grad()));
}

TEST_CASE("add_layer_norm and add_rms_norm on split tokens: add, then the norm's rule; the gradients of one "
          "process", "[dtensor][autograd][add_norm]") {
  const int64_t w = world();
  MeshPtr mesh = init_device_mesh("cpu", {w}, {"sp"});
  // [2, 7, 5]: 7 tokens split as sequence parallelism splits them (uneven at 2-4 ranks, none on some).
  Tensor x0 = randn({2, 7, 5}, 8, DType::F64), r0 = randn({2, 7, 5}, 9, DType::F64);
  Tensor w0 = randn({5}, 10, DType::F64), b0 = randn({5}, 11, DType::F64);
  Tensor gs0 = randn({2, 7, 5}, 12, DType::F64), gy0 = randn({2, 7, 5}, 13, DType::F64);
  for (bool rms : {false, true}) {
    INFO((rms ? "add_rms_norm" : "add_layer_norm"));
    auto leaf = [](Tensor t) {
      t.set_requires_grad(true);
      return t;
    };
    Tensor x = leaf(distribute_tensor(x0, mesh, {Shard{1}})), r = leaf(distribute_tensor(r0, mesh, {Shard{1}}));
    Tensor wt = leaf(distribute_tensor(w0, mesh, {Replicate{}})), bt = leaf(distribute_tensor(b0, mesh, {Replicate{}}));
    auto [s, y] = rms ? add_rms_norm(x, r, wt) : add_layer_norm(x, r, wt, bt);
    REQUIRE(dtensor_spec(s).placements == Placements{Shard{1}});
    REQUIRE(dtensor_spec(y).placements == Placements{Shard{1}});
    autograd::backward({s, y}, {distribute_tensor(gs0, mesh, {Shard{1}}), distribute_tensor(gy0, mesh, {Shard{1}})});
    // The same on whole tensors, on every rank.
    Tensor wx = leaf(ops::clone(x0)), wr = leaf(ops::clone(r0)), ww = leaf(ops::clone(w0)), wb = leaf(ops::clone(b0));
    auto [ws, wy] = rms ? add_rms_norm(wx, wr, ww) : add_layer_norm(wx, wr, ww, wb);
    autograd::backward({ws, wy}, {gs0, gy0});
    // Each row is normalised alone: its results are the same bits on any rank.
    CHECK(equal(full_tensor(s), ws));
    CHECK(equal(full_tensor(y), wy));
    CHECK(dtensor_spec(x.grad()).placements == Placements{Shard{1}});
    CHECK(equal(full_tensor(x.grad()), wx.grad()));
    CHECK(equal(full_tensor(r.grad()), wr.grad()));
    CHECK(allclose(full_tensor(wt.grad()), ww.grad(), 1e-13, 1e-13));  // summed over the ranks' tokens
    if (!rms) CHECK(allclose(full_tensor(bt.grad()), wb.grad(), 1e-13, 1e-13));
  }
}

TEST_CASE("linear_gelu split column-wise, row-wise and by rows: the bias and GELU on each rank's piece, the "
          "gradients of one process", "[dtensor][autograd][linear_gelu]") {
  const int64_t w = world();
  MeshPtr mesh = init_device_mesh("cpu", {w}, {"tp"});
  // 7 output features and 6 input features: uneven pieces at 4 ranks, none on some.
  Tensor x0 = randn({2, 5, 6}, 11, DType::F64), w0 = randn({7, 6}, 12, DType::F64), b0 = randn({7}, 13, DType::F64);
  Tensor g0 = randn({2, 5, 7}, 14, DType::F64);
  // One process's result and gradients.
  Tensor wx = ops::clone(x0), ww = ops::clone(w0), wb = ops::clone(b0);
  for (Tensor* t : {&wx, &ww, &wb}) t->set_requires_grad(true);
  Tensor wy = linear_gelu(wx, ww, wb, true);
  autograd::backward(wy, g0);
  struct Split {
    const char* name;
    Placements x, w, b, y, db;
  };
  for (const Split& s : {Split{"column-wise", {Replicate{}}, {Shard{0}}, {Shard{0}}, {Shard{2}}, {Shard{0}}},
                         Split{"row-wise", {Shard{2}}, {Shard{1}}, {Replicate{}}, {Replicate{}}, {Replicate{}}},
                         Split{"by rows", {Shard{1}}, {Replicate{}}, {Replicate{}}, {Shard{1}}, {Replicate{}}}}) {
    INFO(s.name);
    Tensor x = distribute_tensor(x0, mesh, s.x), wt = distribute_tensor(w0, mesh, s.w);
    Tensor b = distribute_tensor(b0, mesh, s.b);
    for (Tensor* t : {&x, &wt, &b}) t->set_requires_grad(true);
    Tensor y = linear_gelu(x, wt, b, true);
    CHECK(dtensor_spec(y).placements == s.y);
    autograd::backward(y, distribute_tensor(g0, mesh, s.y));
    CHECK(dtensor_spec(b.grad()).placements == s.b);  // a Partial sum over rows reduced as it accumulates
    CHECK_CLOSE(full_tensor(y), wy, 1e-14, 1e-14);
    CHECK_CLOSE(full_tensor(x.grad()), wx.grad(), 1e-13, 1e-13);
    CHECK_CLOSE(full_tensor(wt.grad()), ww.grad(), 1e-13, 1e-13);
    CHECK_CLOSE(full_tensor(b.grad()), wb.grad(), 1e-13, 1e-13);
  }
  // The bias and its gradient through ops::bias_gelu alone: a Partial input
  // is summed before GELU, a bias laid out otherwise is moved to the input's
  // features.
  Tensor h0 = randn({4, 7}, 15, DType::F64);
  Tensor h = distribute_tensor(h0, mesh, {Shard{1}}), b = distribute_tensor(b0, mesh, {Replicate{}});
  Tensor y = ops::bias_gelu(h, b, false);
  CHECK(dtensor_spec(y).placements == Placements{Shard{1}});
  CHECK(equal(full_tensor(y), ops::bias_gelu(h0, b0, false)));
  Tensor g1 = randn({4, 7}, 16, DType::F64);
  TensorList d = ops::bias_gelu_backward(distribute_tensor(g1, mesh, {Shard{0}}), distribute_tensor(h0, mesh, {Shard{0}}),
                                         b, false);
  CHECK(dtensor_spec(d[1]).placements == Placements{Partial{}});
  TensorList whole = ops::bias_gelu_backward(g1, h0, b0, false);
  CHECK_CLOSE(full_tensor(d[1]), whole[1], 1e-14, 1e-14);
  CHECK(equal(full_tensor(d[0]), whole[0]));
  CHECK_THROWS_WITH(ops::bias_gelu(h, b0, false), Catch::Contains("bias_gelu: mixes DTensors and plain tensors (the "
                                                                  "bias is plain)"));
}
