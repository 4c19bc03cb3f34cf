// Optimizer steps against the update rules written out element by element.
#include <cmath>

#include "nn/optim.h"
#include "runtime/kernels.h"
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
  bool fused = GENERATE(true, false);
  INFO("fused " << fused);
  optim::AdamWOptions o{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1, .fused = fused};
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
  optim::LRSchedule s{.max_lr = 1.0, .min_lr = 0.1, .warmup = 4, .total = 14};
  CHECK(s.lr_at(0) == Approx(0.25));
  CHECK(s.lr_at(3) == Approx(1.0));
  CHECK(s.lr_at(4) == Approx(1.0));
  CHECK(s.lr_at(9) == Approx(0.55));  // halfway through the decay
  CHECK(s.lr_at(14) == Approx(0.1));
  CHECK(s.lr_at(100) == Approx(0.1));
  CHECK(s.describe() == "warmup 4 steps, then cosine to 1.00e-01 at step 14");
}

TEST_CASE("linear, constant and warmup-stable-decay schedules", "[optim]") {
  using K = optim::LRSchedule::Kind;
  // 3 warmup steps, the decay ends at step 13 (10 steps after warmup).
  optim::LRSchedule s{.max_lr = 2.0, .min_lr = 0.2, .warmup = 3, .total = 13};
  s.kind = K::Linear;
  CHECK(s.lr_at(1) == Approx(4.0 / 3));
  CHECK(s.lr_at(3) == Approx(2.0));
  CHECK(s.lr_at(8) == Approx(1.1));  // halfway: (2 + 0.2) / 2
  CHECK(s.lr_at(12) == Approx(0.38));
  CHECK(s.lr_at(13) == Approx(0.2));
  CHECK(s.lr_at(1000) == Approx(0.2));
  s.kind = K::Constant;
  CHECK(s.lr_at(0) == Approx(2.0 / 3));
  for (int64_t step : {3, 8, 13, 1000}) CHECK(s.lr_at(step) == Approx(2.0));
  CHECK(s.describe() == "warmup 3 steps, then constant 2.00e+00");
  // WSD: the last 30% of the 10 steps after warmup decay (steps 10, 11, 12).
  s.kind = K::WSD;
  s.decay_ratio = 0.3;
  for (int64_t step : {3, 6, 9}) CHECK(s.lr_at(step) == Approx(2.0));
  CHECK(s.lr_at(10) == Approx(2.0));  // the line starts at the peak
  CHECK(s.lr_at(11) == Approx(2.0 - 1.8 / 3));
  CHECK(s.lr_at(12) == Approx(2.0 - 2 * 1.8 / 3));
  CHECK(s.lr_at(13) == Approx(0.2));
  CHECK(s.describe() == "warmup 3 steps, then stable 2.00e+00, then linear to 2.00e-01 over the last 30% to step 13");
  // No warmup: the first step runs at the peak.
  optim::LRSchedule c{.max_lr = 1.0, .min_lr = 0.0, .warmup = 0, .total = 4};
  CHECK(c.lr_at(0) == Approx(1.0));
  CHECK(c.lr_at(2) == Approx(0.5));
  CHECK_THROWS_WITH(optim::schedule_kind("step"), Catch::Contains("expected cosine, linear, constant or wsd"));
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

namespace {
// The CPU table with its adamw entry counting calls and tensors.
int adamw_calls = 0, adamw_tensors = 0;
KernelTable counting_table;
void counting_adamw(const std::vector<Tensor>& ps, const std::vector<Tensor>& gs, const std::vector<Tensor>& ms,
                    const std::vector<Tensor>& vs, const ops::AdamWStep& step) {
  ++adamw_calls;
  adamw_tensors += static_cast<int>(ps.size());
  cpu::table().adamw(ps, gs, ms, vs, step);
}
}  // namespace

TEST_CASE("fused AdamW: one kernel call per group, the unfused ops' results, f32 and f64", "[optim][fused]") {
  counting_table = cpu::table();
  counting_table.adamw = counting_adamw;
  for (DType dtype : {DType::F32, DType::F64}) {
    INFO(dtype_name(dtype));
    // Awkward sizes: one element, odd lengths, a chunk boundary plus one, a 3-D tensor.
    std::vector<Shape> shapes = {{1}, {17}, {33, 65}, {16385}, {3, 5, 7}};
    auto make = [&] {
      TensorList ps;
      for (size_t i = 0; i < shapes.size(); ++i) {
        Tensor p = ops::to(randn(shapes[i], 10 + i), dtype);
        p.set_requires_grad(true);
        ps.push_back(p);
      }
      return ps;
    };
    TensorList a = make(), b = make();
    // Two groups with their own lr and weight decay.
    auto groups = [](const TensorList& ps) {
      return std::vector<optim::ParamGroup>{{{ps[0], ps[1], ps[2]}, 0.02, 0.1}, {{ps[3], ps[4]}, 0.005, 0.0}};
    };
    optim::AdamW fused(groups(a), {.beta1 = 0.85, .beta2 = 0.97, .eps = 1e-7});
    optim::AdamW unfused(groups(b), {.beta1 = 0.85, .beta2 = 0.97, .eps = 1e-7, .fused = false});
    adamw_calls = adamw_tensors = 0;
    for (int step = 1; step <= 6; ++step) {
      for (size_t i = 0; i < a.size(); ++i) {
        Tensor g = ops::to(randn(shapes[i], 100 * step + i), dtype);
        a[i].set_grad(ops::clone(g));
        b[i].set_grad(ops::clone(g));
      }
      const KernelTable* saved = replace_kernels_for_testing(DeviceType::CPU, &counting_table);
      fused.step();
      unfused.step();
      replace_kernels_for_testing(DeviceType::CPU, saved);
      double rtol = dtype == DType::F64 ? 1e-13 : 2e-6, atol = dtype == DType::F64 ? 1e-15 : 1e-7;
      for (size_t i = 0; i < a.size(); ++i) {
        INFO("step " << step << " parameter " << i);
        CHECK(allclose(a[i], b[i], rtol, atol));
      }
      for (size_t j = 0; j < 3; ++j) {
        CHECK(allclose(fused.state(0, j).exp_avg, unfused.state(0, j).exp_avg, rtol, atol));
        CHECK(allclose(fused.state(0, j).exp_avg_sq, unfused.state(0, j).exp_avg_sq, rtol, atol));
      }
    }
    CHECK(adamw_calls == 6 * 2);          // one call per group per step, from the fused optimizer only
    CHECK(adamw_tensors == 6 * 5);
  }
}

TEST_CASE("fused AdamW takes what it can: bf16 fused, strided or mixed quadruples unfused", "[optim][fused]") {
  Tensor p16 = ops::to(randn({9}, 1), DType::BF16);
  Tensor p32 = randn({4, 6}, 2);
  Tensor strided = ops::transpose(randn({6, 4}, 3), 0, 1);
  CHECK(ops::adamw_fusable(p16, p16, p16, p16));
  CHECK(ops::adamw_fusable(p32, p32, p32, p32));
  CHECK_FALSE(ops::adamw_fusable(p32, strided, p32, p32));
  CHECK_FALSE(ops::adamw_fusable(p32, ops::to(p32, DType::F64), p32, p32));
  CHECK_FALSE(ops::adamw_fusable(p32, p32, p32, Tensor()));
}

TEST_CASE("bf16 AdamW, fused and unfused, follows the f64 update within bf16 rounding", "[optim][fused]") {
  // bf16 parameters and moments, 12 steps of random gradients; the f64 twin
  // starts from the same (bf16) values and sees the same gradients. The fused
  // update rounds once per step; the unfused ops round after each of their 8
  // steps and drift about 3x further (measured: 0.03 vs 0.09 at most).
  std::vector<double> worst;
  for (bool fused : {true, false}) {
    INFO("fused " << fused);
    Tensor p16 = ops::to(randn({300}, 4), DType::BF16);
    Tensor p64 = ops::to(p16, DType::F64);
    p16.set_requires_grad(true);
    p64.set_requires_grad(true);
    optim::AdamWOptions o{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.5, .fused = fused};
    optim::AdamW a({p16}, o), b({p64}, o);
    for (int step = 1; step <= 12; ++step) {
      Tensor g = ops::to(randn({300}, 50 + step), DType::BF16);
      p16.set_grad(g);
      p64.set_grad(ops::to(g, DType::F64));
      a.step();
      b.step();
    }
    // 12 updates of lr 0.01 against parameters of size ~1, with bf16 moments.
    double tol = fused ? 1e-2 : 5e-2;
    CHECK(testing::close_ratio(ops::to(p16, DType::F64), p64, tol, tol) <= 1.0);
    worst.push_back(ops::max(ops::unary(ops::UnaryOp::Abs, ops::sub(ops::to(p16, DType::F64), p64))).item());
  }
  INFO("largest error: fused " << worst[0] << ", unfused " << worst[1]);
  CHECK(worst[0] < worst[1]);
  // The unfused ops keep their scalars in f32: 256 * 0.99 = 253.44 rounds to
  // 253 in bf16, where 0.99 rounded to bf16 first (0.990234375) would give 254.
  Tensor x = full({3}, 256.0, DType::BF16);
  ops::mul_(x, 0.99);
  CHECK(x.to_vector<double>() == std::vector<double>{253.0, 253.0, 253.0});
  ops::add_(x, -0.6);  // 252.4 -> 252
  CHECK(x.to_vector<double>() == std::vector<double>{252.0, 252.0, 252.0});
}

TEST_CASE("an optimizer refuses a parameter listed twice", "[optim]") {
  Tensor p = param({4}, 7);
  CHECK_THROWS_WITH(optim::AdamW({p, p}), Catch::Contains("appears more than once"));
  CHECK_THROWS_WITH(optim::AdamW(std::vector<optim::ParamGroup>{{{p}, 0.1, 0.0}, {{p}, 0.2, 0.0}}, {}),
                    Catch::Contains("appears more than once (group 1)"));
  Tensor q = randn({8}, 8);
  CHECK_THROWS_WITH(ops::adamw_({q, q}, {q, q}, {ops::clone(q), ops::clone(q)}, {ops::clone(q), ops::clone(q)},
                                {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0, .step = 1}),
                    Catch::Contains("share memory"));
}

TEST_CASE("adamw_ refuses lists that do not line up, a step of 0 and unfusable tensors", "[optim][fused]") {
  Tensor p = randn({5}, 1), q = randn({6}, 2);
  CHECK_THROWS_WITH(ops::adamw_({p}, {p, p}, {p}, {p}, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8,
                                                         .weight_decay = 0, .step = 1}),
                    Catch::Contains("as many gradients and moments as parameters (1), got 2, 1 and 1"));
  CHECK_THROWS_WITH(ops::adamw_({p}, {p}, {p}, {p}, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8,
                                                      .weight_decay = 0, .step = 0}),
                    Catch::Contains("step count >= 1, got 0"));
  CHECK_THROWS_WITH(ops::adamw_({p}, {q}, {p}, {p}, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8,
                                                      .weight_decay = 0, .step = 1}),
                    Catch::Contains("parameter 0 ([5] f32 on cpu)"));
}

namespace {
int scale_calls = 0;
KernelTable scale_counting;
void counting_scale(const std::vector<Tensor>& xs, const Tensor& coef) {
  ++scale_calls;
  cpu::table().scale(xs, coef);
}

// Bit-for-bit equality of two float tensors of one dtype.
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  auto va = ops::to(a, DType::F64).to_vector<double>(), vb = ops::to(b, DType::F64).to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i)
    if (va[i] != vb[i]) return false;
  return true;
}
}  // namespace

TEST_CASE("scale_: many tensors of mixed dtypes in one kernel call, mul_'s bits, the coefficient unrounded", "[optim]") {
  scale_counting = cpu::table();
  scale_counting.scale = counting_scale;
  const std::vector<std::pair<Shape, DType>> specs = {{{1}, DType::BF16}, {{17}, DType::F32},  {{33, 65}, DType::F64},
                                                      {{16385}, DType::BF16}, {{3, 5, 7}, DType::F16}, {{0}, DType::F32}};
  for (double c : {0.99, 0.123456789, 1.0 / 3.0, 2.5e-4}) {
    INFO("coefficient " << c);
    TensorList xs, refs;
    for (size_t i = 0; i < specs.size(); ++i) {
      xs.push_back(ops::to(ops::mul(randn(specs[i].first, 40 + i, DType::F64), 3.0), specs[i].second));
      refs.push_back(ops::clone(xs.back()));
    }
    scale_calls = 0;
    const KernelTable* saved = replace_kernels_for_testing(DeviceType::CPU, &scale_counting);
    ops::scale_(xs, full({}, c, DType::F64));
    replace_kernels_for_testing(DeviceType::CPU, saved);
    CHECK(scale_calls == 1);
    for (size_t i = 0; i < xs.size(); ++i) {
      INFO("tensor " << i << " " << dtype_name(xs[i].dtype()));
      ops::mul_(refs[i], c);
      CHECK(same_bits(xs[i], refs[i]));
    }
  }
  // The old CUDA path multiplied a bf16 gradient by the coefficient rounded
  // to bf16 (0.99 -> 0.990234375): scale_ does not.
  Tensor g = ops::to(randn({4097}, 7, DType::F64), DType::BF16);
  Tensor by_scale = ops::clone(g), by_rounded = ops::clone(g);
  ops::scale_({by_scale}, full({}, 0.99, DType::F64));
  ops::mul_(by_rounded, ops::to(full({}, 0.99, DType::F64), DType::BF16));
  CHECK_FALSE(same_bits(by_scale, by_rounded));
  // Refusals name what was expected.
  CHECK_THROWS_WITH(ops::scale_({g}, full({2}, 0.5, DType::F64)), Catch::Contains("0-dim float tensor"));
  CHECK_THROWS_WITH(ops::scale_({randint({4}, 0, 9, 1)}, full({}, 0.5, DType::F64)),
                    Catch::Contains("contiguous float tensor"));
  CHECK_THROWS_WITH(ops::scale_({ops::transpose(randn({3, 4}, 1), 0, 1)}, full({}, 0.5, DType::F64)),
                    Catch::Contains("tensor 0 must be a local, contiguous"));
  CHECK_THROWS_WITH(ops::scale_({ops::to(g, Device::async_cpu())}, full({}, 0.5, DType::F64)),
                    Catch::Contains("is on async_cpu but the coefficient on cpu"));
}

TEST_CASE("clip_grad_norm_ on a device the host cannot read: the host's bits, bf16 gradients scaled in f32", "[optim][async]") {
  // async_cpu stands for CUDA here: the coefficient stays on the device and
  // every gradient is scaled in one pass; the result must be the CPU's.
  const std::vector<std::pair<Shape, DType>> specs = {{{31, 7}, DType::BF16}, {{129}, DType::BF16},
                                                      {{5, 3, 2}, DType::F32}, {{1}, DType::BF16}};
  auto make = [&](Device device) {
    TensorList ps;
    for (size_t i = 0; i < specs.size(); ++i) {
      Tensor p = ops::to(zeros(specs[i].first, specs[i].second), device);
      p.set_requires_grad(true);
      p.set_grad(ops::to(ops::to(ops::mul(randn(specs[i].first, 60 + i, DType::F64), 2.0), specs[i].second), device));
      ps.push_back(p);
    }
    return ps;
  };
  for (double max_norm : {0.7, 1e6}) {  // clipped, and under the limit (then scaled by exactly 1 on the device)
    INFO("max_norm " << max_norm);
    TensorList host = make(Device::cpu()), dev = make(Device::async_cpu());
    double n_host = nn::clip_grad_norm_(host, max_norm).item();
    double n_dev = ops::to(nn::clip_grad_norm_(dev, max_norm), Device::cpu()).item();
    CHECK(n_host == n_dev);
    for (size_t i = 0; i < host.size(); ++i) {
      INFO("gradient " << i);
      CHECK(same_bits(host[i].grad(), ops::to(dev[i].grad(), Device::cpu())));
    }
    if (max_norm < 1) CHECK(nn::grad_norm(host).item() == Approx(max_norm).epsilon(1e-2));
  }
}
