// The tape's semantics: grad mode, leaves, accumulation, hooks, markers,
// end-of-backward callbacks and activation checkpointing.
#include "autograd/functions.h"
#include "tests/helpers.h"

using namespace tessera;
using tessera::testing::allclose;
using tessera::testing::equal;

namespace {
Tensor leaf(const Shape& s, uint64_t seed) {
  Tensor t = randn(s, seed, DType::F64);
  t.set_requires_grad(true);
  return t;
}
}  // namespace

TEST_CASE("leaves, non-leaves and grad mode", "[tape]") {
  Tensor x = leaf({3}, 1);
  Tensor c = randn({3}, 2, DType::F64);
  CHECK(x.is_leaf());
  Tensor y = x * c;
  CHECK(y.requires_grad());
  CHECK_FALSE(y.is_leaf());
  Tensor z = c * c;  // no input requires grad: nothing recorded
  CHECK_FALSE(z.requires_grad());
  {
    autograd::NoGradGuard guard;
    Tensor w = x * c;
    CHECK_FALSE(w.requires_grad());
    CHECK_FALSE(autograd::is_grad_enabled());
  }
  CHECK(autograd::is_grad_enabled());
  autograd::backward(sum(y));
  CHECK(equal(x.grad(), c));
  CHECK_FALSE(y.grad().defined());  // non-leaf without retain_grad
  CHECK(autograd::tape_size() == 0);  // backward consumed the tape
  CHECK_THROWS_WITH(Tensor(from_vector<int64_t>({1}, {1})).set_requires_grad(true),
                    Catch::Contains("only floating-point tensors"));
}

TEST_CASE(".grad accumulates across backward calls; set_grad clears", "[tape]") {
  Tensor x = leaf({4}, 3);
  for (int i = 0; i < 3; ++i) autograd::backward(sum(x * 2.0));
  CHECK(equal(x.grad(), full({4}, 6.0, DType::F64)));
  x.set_grad(Tensor());
  autograd::backward(sum(x));
  CHECK(equal(x.grad(), ones({4}, DType::F64)));
}

TEST_CASE("a tensor used twice sums both paths; the grad does not alias", "[tape]") {
  Tensor x = leaf({5}, 4);
  Tensor y = x * x + x;  // dy/dx = 2x + 1
  autograd::backward(sum(y));
  CHECK(allclose(x.grad(), ops::add(ops::mul(x, 2.0), 1.0), 1e-12, 1e-12));
  // add's backward hands the same gradient to both inputs: the leaves must not share it.
  Tensor a = leaf({2}, 5), b = leaf({2}, 6);
  autograd::backward(sum(a + b));
  CHECK(a.grad().storage() != b.grad().storage());
  Tensor ag = a.grad();
  ops::fill_(ag, 7.0);
  CHECK(b.grad().to_vector<double>() == std::vector<double>{1.0, 1.0});
}

TEST_CASE("backward(grad) with an explicit gradient; errors", "[tape]") {
  Tensor x = leaf({2, 3}, 7);
  Tensor y = x * 3.0;
  Tensor g = randn({2, 3}, 8, DType::F64);
  autograd::backward(y, g);
  CHECK(allclose(x.grad(), ops::mul(g, 3.0), 1e-12, 1e-12));
  Tensor y2 = x * 3.0;
  CHECK_THROWS_WITH(autograd::backward(y2), Catch::Contains("only for one-element outputs"));
  autograd::clear_tape();
  CHECK_THROWS_WITH(autograd::backward(sum(randn({2}, 1, DType::F64))),
                    Catch::Contains("does not require grad"));
  Tensor y3 = sum(x * 2.0);
  autograd::backward(y3);
  CHECK_THROWS_WITH(autograd::backward(y3), Catch::Contains("not on the tape"));
}

TEST_CASE("detach and retain_grad", "[tape]") {
  Tensor x = leaf({3}, 9);
  Tensor h = x * 2.0;
  autograd::retain_grad(h);
  Tensor d = detach(h);
  CHECK_FALSE(d.requires_grad());
  CHECK(d.storage() == h.storage());
  Tensor y = sum(h * h + d);  // d contributes no gradient
  autograd::backward(y);
  CHECK(allclose(h.grad(), ops::mul(h, 2.0), 1e-12, 1e-12));
  CHECK(allclose(x.grad(), ops::mul(h, 4.0), 1e-12, 1e-12));
}

TEST_CASE("tensor hooks see and may replace gradients", "[tape][hooks]") {
  Tensor x = leaf({3}, 10);
  Tensor h = x * 2.0;
  Tensor seen;
  autograd::register_hook(h, [&](const Tensor& g) {
    seen = ops::clone(g);
    return ops::mul(g, 10.0);  // replaces the gradient flowing further
  });
  int leaf_hook_calls = 0;
  autograd::register_hook(x, [&](const Tensor&) {
    ++leaf_hook_calls;
    return Tensor();  // keep
  });
  int post_acc = 0;
  autograd::register_post_accumulate_grad_hook(x, [&](const Tensor& t) {
    ++post_acc;
    CHECK(t.grad().defined());
  });
  autograd::backward(sum(h * 3.0 + h));  // h used twice: its hook runs once, on the sum
  CHECK(equal(seen, full({3}, 4.0, DType::F64)));
  CHECK(equal(x.grad(), full({3}, 80.0, DType::F64)));
  CHECK(leaf_hook_calls == 1);
  CHECK(post_acc == 1);
}

TEST_CASE("the leaves of one op complete in the op's input order, whatever their ids", "[tape][hooks]") {
  // A DTensor leaf's gradient may need a collective as it completes (laid out
  // as its parameter), so every rank must complete them in one order: the
  // op's input order, not the order the leaves were made in (ids, which
  // differ between ranks). Here many leaves made in a shuffled order feed
  // one op each, and stacked ops share some.
  std::vector<Tensor> made(12);
  for (size_t i : {7u, 2u, 11u, 0u, 5u, 9u, 1u, 10u, 3u, 8u, 6u, 4u})
    made[i] = leaf(i % 3 == 2 ? Shape{1} : Shape{1, 2}, 40 + i);  // x, w, b of a Linear(2, 1)
  std::vector<size_t> order;
  for (size_t i = 0; i < made.size(); ++i)
    autograd::register_post_accumulate_grad_hook(made[i], [&order, i](const Tensor&) { order.push_back(i); });
  // linear(x, w, b) uses three leaves at once; the loss reads them in index order.
  Tensor total = zeros({}, DType::F64);
  for (size_t i = 0; i + 2 < made.size(); i += 3)
    total = total + sum(linear(made[i], made[i + 1], made[i + 2]));
  autograd::backward(total);
  // The last op's leaves complete first (the walk goes backwards), each op's in input order.
  CHECK(order == std::vector<size_t>{9, 10, 11, 6, 7, 8, 3, 4, 5, 0, 1, 2});
}

TEST_CASE("markers run when the walk reaches them, in reverse order", "[tape][markers]") {
  std::vector<std::string> events;
  Tensor x = leaf({4}, 11);
  Tensor w1 = leaf({4}, 12), w2 = leaf({4}, 13);
  autograd::record_marker("post-backward 1", [&] {
    // Everything recorded after this marker has been walked: w1's grad is complete.
    CHECK(w1.grad().defined());
    events.push_back("post1");
  });
  Tensor h = x * w1;
  autograd::record_marker("pre-backward 1", [&] { events.push_back("pre1"); }, {h});
  autograd::record_marker("post-backward 2", [&] {
    CHECK(w2.grad().defined());
    events.push_back("post2");
  });
  Tensor out = h * w2;
  autograd::record_marker("pre-backward 2", [&] {
    CHECK_FALSE(w2.grad().defined());
    events.push_back("pre2");
  }, {out});
  Tensor unused = x * 5.0;
  autograd::record_marker("never", [&] { events.push_back("unused"); }, {unused});
  autograd::backward(sum(out));
  CHECK(events == std::vector<std::string>{"pre2", "post2", "pre1", "post1"});
  CHECK(allclose(x.grad(), ops::mul(w1, w2), 1e-12, 1e-12));
}

TEST_CASE("end-of-backward callbacks run once after the walk, in order", "[tape][callbacks]") {
  std::vector<int> order;
  Tensor x = leaf({2}, 14);
  Tensor y = x * 2.0;
  autograd::record_marker("queues", [&] {
    autograd::queue_callback([&] {
      order.push_back(1);
      CHECK(x.grad().defined());  // the walk (and leaf accumulation) is over
      autograd::queue_callback([&] { order.push_back(3); });  // callbacks may queue more
    });
    autograd::queue_callback([&] { order.push_back(2); });
  });
  Tensor z = sum(y * y);
  CHECK_THROWS_WITH(autograd::queue_callback([] {}), Catch::Contains("only possible while backward"));
  autograd::backward(z);
  CHECK(order == std::vector<int>{1, 2, 3});
}

TEST_CASE("activation checkpointing matches the plain graph and recomputes", "[tape][checkpoint]") {
  Tensor w = leaf({6, 6}, 15);
  Tensor b = leaf({6}, 16);
  Tensor x0 = randn({4, 6}, 17, DType::F64);
  int calls = 0;
  auto segment = [&](const TensorList& in) {
    ++calls;
    Tensor h = gelu(linear(in[0], w, b));
    return TensorList{dropout(h, 0.3, true) * 2.0};
  };
  // Plain: same generator state.
  manual_seed(5);
  Tensor x = ops::clone(x0);
  x.set_requires_grad(true);
  Tensor ref = sum(square(segment({x})[0]));
  autograd::backward(ref);
  Tensor gw = ops::clone(w.grad()), gb = ops::clone(b.grad()), gx = ops::clone(x.grad());
  w.set_grad(Tensor());
  b.set_grad(Tensor());
  // Checkpointed.
  manual_seed(5);
  Tensor x2 = ops::clone(x0);
  x2.set_requires_grad(true);
  calls = 0;
  size_t tape_before = autograd::tape_size();
  Tensor out = autograd::checkpoint(segment, {x2})[0];
  CHECK(autograd::tape_size() == tape_before + 1);  // one node, no saved activations
  CHECK(calls == 1);
  Tensor loss = sum(square(out));
  CHECK(loss.item() == Approx(ref.item()).epsilon(1e-12));
  autograd::backward(loss);
  CHECK(calls == 2);  // recomputed in backward
  CHECK(allclose(w.grad(), gw, 1e-12, 1e-12));
  CHECK(allclose(b.grad(), gb, 1e-12, 1e-12));
  CHECK(allclose(x2.grad(), gx, 1e-12, 1e-12));
}

TEST_CASE("checkpointed segments with markers inside run them in the nested backward",
          "[tape][checkpoint]") {
  Tensor w = leaf({3}, 18);
  Tensor x = randn({3}, 19, DType::F64);  // no input requires grad; the parameter does
  int fired = 0;
  auto seg = [&](const TensorList& in) {
    autograd::record_marker("inner", [&] { ++fired; });
    return TensorList{in[0] * w};
  };
  Tensor y = autograd::checkpoint(seg, {x})[0];
  CHECK(y.requires_grad());
  autograd::backward(sum(y));
  CHECK(fired == 1);  // recorded during the recompute, walked by the nested backward
  CHECK(allclose(w.grad(), x, 1e-12, 1e-12));
}

TEST_CASE("in-place ops refuse tensors autograd tracks", "[tape]") {
  Tensor x = leaf({3}, 20);
  CHECK_THROWS_WITH(fill_(x, 1.0), Catch::Contains("in-place update of a tensor that requires grad"));
  {
    autograd::NoGradGuard g;
    fill_(x, 1.0);
  }
  CHECK(x.to_vector<double>() == std::vector<double>{1, 1, 1});
}

TEST_CASE("dtype conversions carry gradients back in the input dtype", "[tape]") {
  Tensor x = leaf({5}, 21);
  Tensor y = to(x, DType::BF16);
  CHECK(y.dtype() == DType::BF16);
  Tensor g = randn({5}, 22, DType::BF16);
  autograd::backward(y, g);
  CHECK(x.grad().dtype() == DType::F64);
  CHECK(equal(x.grad(), ops::to(g, DType::F64)));
}

TEST_CASE("dropout: inverted scaling, mask reused in backward, identity in eval", "[tape][dropout]") {
  Tensor x = ops::add(ops::unary(ops::UnaryOp::Abs, randn({20000}, 23, DType::F64)), 0.1);
  x.set_requires_grad(true);
  manual_seed(3);
  Tensor y = dropout(x, 0.25, true);
  auto vx = x.to_vector<double>(), vy = y.to_vector<double>();
  int zeros_count = 0;
  for (size_t i = 0; i < vx.size(); ++i) {
    if (vy[i] == 0.0) ++zeros_count;
    else CHECK(vy[i] == Approx(vx[i] / 0.75).epsilon(1e-12));
  }
  CHECK(zeros_count / 20000.0 == Approx(0.25).margin(0.015));
  autograd::backward(sum(y));
  auto g = x.grad().to_vector<double>();
  for (size_t i = 0; i < vx.size(); ++i) CHECK(g[i] == (vy[i] == 0.0 ? 0.0 : 1.0 / 0.75));
  CHECK(dropout(x, 0.25, false).is_same(x));
  // The same seed gives the same mask.
  manual_seed(3);
  CHECK(testing::equal(detach(dropout(x, 0.25, true)), detach(y)));
  CHECK_THROWS_WITH(dropout(x, 1.0, true), Catch::Contains("probability must be in [0, 1)"));
}

TEST_CASE("comparisons return bool tensors that carry no gradient", "[tape][compare]") {
  using Fn = Tensor (*)(const Tensor&, const Tensor&);
  std::vector<std::tuple<const char*, Fn, ops::BinaryOp>> cmps = {
      {"lt", lt, ops::BinaryOp::Lt}, {"le", le, ops::BinaryOp::Le}, {"gt", gt, ops::BinaryOp::Gt},
      {"ge", ge, ops::BinaryOp::Ge}, {"eq", eq, ops::BinaryOp::Eq}, {"ne", ne, ops::BinaryOp::Ne}};
  // Rounded to halves so that ties occur; [3, 17] against a row [17].
  Tensor a = ops::mul(ops::to(randint({3, 17}, -2, 3, 1), DType::F64), 0.5);
  Tensor b = ops::mul(ops::to(randint({17}, -2, 3, 2), DType::F64), 0.5);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  for (auto& [name, fn, op] : cmps) {
    INFO(name);
    size_t before = autograd::tape_size();
    Tensor r = fn(a, b);
    CHECK(r.dtype() == DType::Bool);
    CHECK(r.shape() == Shape{3, 17});
    CHECK_FALSE(r.requires_grad());
    CHECK(autograd::tape_size() == before);  // nothing recorded
    CHECK(r.to_vector<double>() == ops::binary(op, a, b).to_vector<double>());
  }
  // Used as a mask, the comparison routes gradients and gets none itself.
  Tensor y = sum(where(gt(a, b), a, b * 2.0));
  autograd::backward(y);
  auto mask = ops::binary(ops::BinaryOp::Gt, a, b).to_vector<double>();
  auto ga = a.grad().to_vector<double>();
  for (size_t i = 0; i < mask.size(); ++i) CHECK(ga[i] == mask[i]);
}

TEST_CASE("a hook on a non-leaf fires after the tensor itself is gone", "[tape][hooks]") {
  // As PyTorch's hooks live on grad_fn: a module output consumed by the next
  // layer and then dropped still reports (and may replace) its gradient.
  Tensor x = leaf({5}, 11);
  Tensor seen;
  Tensor y;
  {
    Tensor h = tanh(x);
    autograd::register_hook(h, [&](const Tensor& g) {
      seen = ops::clone(g);
      return ops::mul(g, 0.5);
    });
    y = h * 3.0;
  }  // h's tensor object is gone; only the tape knows it
  autograd::backward(sum(y));
  CHECK(equal(seen, full({5}, 3.0, DType::F64)));
  Tensor t = tanh(detach(x));
  CHECK(allclose(x.grad(), (ones({5}, DType::F64) - t * t) * 1.5, 1e-12, 1e-12));
  // A throwing hook stops the backward with its exception.
  x.set_grad(Tensor());
  Tensor z;
  {
    Tensor h = tanh(x);
    autograd::register_hook(h, [](const Tensor&) -> Tensor { throw Error("hook failed"); });
    z = h * 2.0;
  }
  CHECK_THROWS_WITH(autograd::backward(sum(z)), Catch::Contains("hook failed"));
  autograd::clear_tape();
}

TEST_CASE("a backward in two parts computes what one computes, the weights' part when asked", "[tape][split]") {
  // A small stage: its input x (a leaf whose gradient is wanted at once, as a
  // pipeline stage's), a linear with bias, a GELU, a layer norm, a matmul
  // with a parameter, and a parameter used alone.
  auto build = [](uint64_t seed) {
    std::vector<Tensor> t = {leaf({5, 7}, seed), leaf({6, 7}, seed + 1), leaf({6}, seed + 2), leaf({6}, seed + 3),
                             leaf({6}, seed + 4), leaf({6, 3}, seed + 5), leaf({3}, seed + 6)};
    return t;
  };
  auto forward = [](const std::vector<Tensor>& t, std::vector<std::string>* events) {
    const Tensor &x = t[0], &w1 = t[1], &b1 = t[2], &g = t[3], &beta = t[4], &m = t[5], &alone = t[6];
    autograd::record_marker("post", [events] { events->push_back("marker"); });  // watches nothing: deferred
    Tensor h = gelu(linear(x, w1, b1));
    h = layer_norm(h, g, beta, 1e-5);
    Tensor y = matmul(h, m);
    Tensor loss = add(sum(square(y)), sum(mul(alone, alone)));
    return loss;
  };
  std::vector<std::string> events;
  std::vector<Tensor> whole = build(11), split = build(11);
  autograd::backward(forward(whole, &events));
  CHECK(events == std::vector<std::string>{"marker"});

  events.clear();
  Tensor loss = forward(split, &events);
  auto deferred = autograd::backward_input({loss}, {Tensor()}, {split[0]});
  // The input's gradient now, bit for bit; no parameter's yet, nor the marker.
  REQUIRE(split[0].grad().defined());
  CHECK(equal(split[0].grad(), whole[0].grad()));
  for (size_t i = 1; i < split.size(); ++i) CHECK_FALSE(split[i].grad().defined());
  CHECK(events.empty());
  autograd::backward_weight(*deferred);
  CHECK(events == std::vector<std::string>{"marker"});
  for (size_t i = 0; i < split.size(); ++i) {
    INFO("tensor " << i);
    REQUIRE(split[i].grad().defined());
    CHECK(equal(split[i].grad(), whole[i].grad()));
  }
  CHECK_THROWS_WITH(autograd::backward_weight(*deferred), Catch::Contains("already computed"));
}

TEST_CASE("split backwards of several micro-batches in flight each run their own callbacks", "[tape][split]") {
  Tensor w = leaf({4, 3}, 21);
  std::vector<std::shared_ptr<autograd::WeightGradients>> pending;
  std::vector<uint64_t> passes;
  std::vector<int> ran;
  for (int mb = 0; mb < 3; ++mb) {
    Tensor x = leaf({2, 3}, 30 + static_cast<uint64_t>(mb));
    Tensor y = linear(x, w, Tensor());
    autograd::record_marker("pre", [&, mb] {  // watches the output: runs in the input's part (FSDP's pre-backward)
      passes.push_back(autograd::backward_pass_id());
      autograd::queue_callback([&ran, mb] { ran.push_back(mb); });
    }, {y});
    Tensor loss = sum(y);
    pending.push_back(autograd::backward_input({loss}, {Tensor()}, {x}));
  }
  CHECK(ran.empty());
  CHECK(passes.size() == 3);  // the markers that watch ran in the input's part
  for (auto& p : pending) autograd::backward_weight(*p);
  CHECK(ran == std::vector<int>{0, 1, 2});  // each backward_weight ran the callback its backward_input queued
  CHECK(passes[0] != passes[1]);
  CHECK(passes[1] != passes[2]);
  CHECK(autograd::backward_pass_id() == 0);
}
