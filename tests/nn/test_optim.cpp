// Optimizer steps against the update rules written out element by element.
#include <cmath>

#include "nn/optim.h"
#include "tests/helpers.h"

using namespace tessera;
using tessera::testing::allclose;

namespace {
Tensor param(const Shape& s, uint64_t seed) {
  Tensor p = randn(s, seed, DType::F64);
  p.set_requires_grad(true);
  return p;
}
}  // namespace

TEST_CASE("AdamW matches the decoupled-weight-decay update", "[optim]") {
  optim::AdamWOptions o{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1};
  Tensor p = param({17}, 1);
  std::vector<double> ref = p.to_vector<double>(), m(17, 0.0), v(17, 0.0);
  optim::AdamW opt({p}, o);
  for (int step = 1; step <= 5; ++step) {
    Tensor g = randn({17}, 100 + step, DType::F64);
    p.set_grad(g);
    opt.step();
    auto gv = g.to_vector<double>();
    for (size_t i = 0; i < 17; ++i) {
      ref[i] *= 1 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * gv[i];
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * gv[i] * gv[i];
      double mh = m[i] / (1 - std::pow(o.beta1, step)), vh = v[i] / (1 - std::pow(o.beta2, step));
      ref[i] -= o.lr * mh / (std::sqrt(vh) + o.eps);
    }
    CHECK(allclose(p, from_vector(ref, {17}), 1e-12, 1e-13));
  }
  CHECK(opt.state(0, 0).step == 5);
}

TEST_CASE("AdamW skips parameters without gradients; groups keep their own settings", "[optim]") {
  Tensor a = param({3}, 2), b = param({3}, 3);
  Tensor b0 = ops::clone(b);
  optim::AdamW opt(std::vector<optim::ParamGroup>{{{a}, 0.1, 0.0}, {{b}, 0.5, 0.5}}, {});
  a.set_grad(ones({3}, DType::F64));
  opt.step();
  CHECK(testing::equal(b, b0));
  CHECK(opt.state(1, 0).step == 0);
  b.set_grad(ones({3}, DType::F64));
  opt.step();
  // First step of Adam moves by lr * sign(g) (up to eps) after decay lr*wd.
  auto bv = b.to_vector<double>(), b0v = b0.to_vector<double>();
  for (size_t i = 0; i < 3; ++i) CHECK(bv[i] == Approx(b0v[i] * (1 - 0.25) - 0.5).epsilon(1e-6));
}

TEST_CASE("SGD with momentum, dampening, nesterov and weight decay", "[optim]") {
  for (bool nesterov : {false, true}) {
    optim::SGDOptions o{.lr = 0.1, .momentum = 0.9, .dampening = nesterov ? 0.0 : 0.2,
                        .weight_decay = 0.01, .nesterov = nesterov};
    Tensor p = param({5}, 4);
    std::vector<double> ref = p.to_vector<double>(), buf(5, 0.0);
    optim::SGD opt({p}, o);
    for (int step = 0; step < 4; ++step) {
      Tensor g = randn({5}, 200 + step, DType::F64);
      p.set_grad(g);
      opt.step();
      auto gv = g.to_vector<double>();
      for (size_t i = 0; i < 5; ++i) {
        double d = gv[i] + o.weight_decay * ref[i];
        buf[i] = step == 0 ? d : o.momentum * buf[i] + (1 - o.dampening) * d;
        double upd = nesterov ? d + o.momentum * buf[i] : buf[i];
        ref[i] -= o.lr * upd;
      }
      CHECK(allclose(p, from_vector(ref, {5}), 1e-12, 1e-13));
    }
  }
}

TEST_CASE("warmup + cosine schedule", "[optim]") {
  optim::WarmupCosine s{.max_lr = 1.0, .min_lr = 0.1, .warmup = 4, .total = 14};
  CHECK(s.lr_at(0) == Approx(0.25));
  CHECK(s.lr_at(3) == Approx(1.0));
  CHECK(s.lr_at(4) == Approx(1.0));
  CHECK(s.lr_at(9) == Approx(0.55));  // halfway through the decay
  CHECK(s.lr_at(14) == Approx(0.1));
  CHECK(s.lr_at(100) == Approx(0.1));
}

TEST_CASE("clip_grad_norm_ scales to the max norm and reports the norm", "[optim]") {
  Tensor a = param({3}, 5), b = param({4}, 6);
  a.set_grad(from_vector<double>({3, 0, 0}, {3}));
  b.set_grad(from_vector<double>({0, 4, 0, 0}, {4}));
  double n = nn::clip_grad_norm_({a, b}, 1.0).item();
  CHECK(n == Approx(5.0));
  CHECK(nn::grad_norm({a, b}).item() == Approx(1.0).epsilon(1e-5));
  double n2 = nn::clip_grad_norm_({a, b}, 10.0).item();  // below the max: unchanged
  CHECK(n2 == Approx(1.0).epsilon(1e-5));
  CHECK(a.grad().to_vector<double>()[0] == Approx(0.6).epsilon(1e-5));
}

TEST_CASE("SGD without momentum: plain and with weight decay", "[optim]") {
  // By hand: p - lr * (g + wd * p).
  Tensor p = param({2}, 1);
  ops::copy_(p, from_vector<double>({1.0, -2.0}, {2}));
  optim::SGD opt({p}, {.lr = 0.1, .weight_decay = 0.2});
  Tensor g = from_vector<double>({0.5, 0.25}, {2});
  p.set_grad(g);
  opt.step();
  CHECK(p.to_vector<double>()[0] == Approx(0.93).epsilon(1e-14));    // 1 - 0.1 * (0.5 + 0.2)
  CHECK(p.to_vector<double>()[1] == Approx(-1.985).epsilon(1e-14));  // -2 - 0.1 * (0.25 - 0.4)
  CHECK(g.to_vector<double>() == std::vector<double>{0.5, 0.25});  // the decay does not touch .grad
  CHECK_FALSE(opt.momentum_buffer(0).defined());

  for (double wd : {0.0, 0.05}) {
    INFO("weight decay " << wd);
    for (int64_t n : {1, 17, 257}) {
      Tensor a = param({n}, static_cast<uint64_t>(n)), idle = param({3}, 7);
      Tensor idle0 = ops::clone(idle);
      std::vector<double> ref = a.to_vector<double>();
      optim::SGD sgd({a, idle}, {.lr = 0.03, .weight_decay = wd});
      for (int step = 0; step < 3; ++step) {
        Tensor grad = randn({n}, 300 + static_cast<uint64_t>(step), DType::F64);
        a.set_grad(grad);
        sgd.step();
        auto gv = grad.to_vector<double>();
        for (size_t i = 0; i < ref.size(); ++i) ref[i] -= 0.03 * (gv[i] + wd * ref[i]);
        CHECK(allclose(a, from_vector(ref, {n}), 1e-14, 1e-15));
      }
      CHECK(testing::equal(idle, idle0));  // no gradient: not stepped, not decayed
      CHECK_FALSE(sgd.momentum_buffer(0).defined());
    }
  }
}
