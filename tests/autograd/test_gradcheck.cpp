// Every differentiable op against central differences in f64, at awkward sizes.
#include <numeric>

#include "autograd/functions.h"
#include "autograd/gradcheck.h"
#include "nn/layers.h"
#include "runtime/allocator.h"
#include "tests/helpers.h"

using namespace tessera;
using autograd::gradcheck;

namespace {
Tensor rnd(const Shape& s, uint64_t seed) { return randn(s, seed, DType::F64); }
// Values bounded away from zero (for log, sqrt, div, pow).
Tensor positive(const Shape& s, uint64_t seed) { return uniform(s, 0.5, 2.0, seed, DType::F64); }

template <class F, class... T>
autograd::GradcheckResult check_grads(F fn, T... inputs) {
  return gradcheck(fn, TensorList{inputs...});
}

// Variadic so that lambdas with several captures pass through the macro.
#define GRADCHECK(...)                         \
  do {                                         \
    auto r_ = check_grads(__VA_ARGS__);        \
    INFO(r_.message);                          \
    CHECK(r_.ok);                              \
  } while (0)

const std::vector<int64_t> kSizes = {1, 3, 17, 257};
}  // namespace

TEST_CASE("gradcheck: unary elementwise ops", "[gradcheck]") {
  using F = Tensor (*)(const Tensor&);
  std::vector<std::pair<const char*, F>> ops_any = {
      {"neg", neg},   {"exp", exp},         {"tanh", tanh}, {"sigmoid", sigmoid},
      {"silu", silu}, {"sin", sin},         {"cos", cos},   {"square", square},
  };
  std::vector<std::pair<const char*, F>> ops_positive = {
      {"log", log}, {"sqrt", sqrt}, {"rsqrt", rsqrt}};
  for (int64_t n : kSizes) {
    for (auto& [name, f] : ops_any) {
      INFO(name << " n=" << n);
      GRADCHECK([f = f](const TensorList& x) { return f(x[0]); }, rnd({n}, n));
    }
    for (auto& [name, f] : ops_positive) {
      INFO(name << " n=" << n);
      GRADCHECK([f = f](const TensorList& x) { return f(x[0]); }, positive({n}, n));
    }
    // Kinks: keep inputs away from 0 (random signs, magnitudes in [0.5, 2]).
    Tensor sign = ops::add(
        ops::mul(ops::to(ops::binary(ops::BinaryOp::Ge, rnd({n}, 9), 0.0), DType::F64), 2.0), -1.0);
    Tensor xs = ops::mul(sign, positive({n}, 3));
    GRADCHECK([](const TensorList& x) { return relu(x[0]); }, xs);
    GRADCHECK([](const TensorList& x) { return abs(x[0]); }, xs);
    GRADCHECK([](const TensorList& x) { return gelu(x[0]); }, rnd({n}, 4));
    GRADCHECK([](const TensorList& x) { return gelu(x[0], true); }, rnd({n}, 5));
  }
}

TEST_CASE("gradcheck: binary ops with broadcasting", "[gradcheck]") {
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    Tensor a = rnd({3, n}, 1), b = rnd({n}, 2), c = rnd({3, 1}, 3);
    GRADCHECK([](const TensorList& x) { return x[0] + x[1]; }, a, b);
    GRADCHECK([](const TensorList& x) { return x[0] - x[1]; }, a, c);
    GRADCHECK([](const TensorList& x) { return x[0] * x[1]; }, a, b);
    GRADCHECK([](const TensorList& x) { return x[0] / x[1]; }, a, positive({3, 1}, 4));
    GRADCHECK([](const TensorList& x) { return pow(x[0], 2.5); }, positive({n}, 5));
    GRADCHECK([](const TensorList& x) { return pow(x[0], x[1]); }, positive({3, n}, 6), rnd({n}, 7));
    GRADCHECK([](const TensorList& x) { return maximum(x[0], x[1]); }, a, rnd({3, n}, 8));
    GRADCHECK([](const TensorList& x) { return minimum(x[0], x[1]); }, a, rnd({3, n}, 9));
    GRADCHECK([](const TensorList& x) { return x[0] * 3.0 + 1.5; }, a);
    Tensor cond = ops::binary(ops::BinaryOp::Gt, rnd({3, n}, 10), 0.0);
    GRADCHECK([cond](const TensorList& x) { return where(cond, x[0], x[1]); }, a, b);
  }
}

TEST_CASE("gradcheck: views and shape ops", "[gradcheck]") {
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    Tensor x = rnd({2, n, 3}, n);
    GRADCHECK([n](const TensorList& t) { return reshape(t[0], {n, 6}); }, x);
    GRADCHECK([](const TensorList& t) { return permute(t[0], {2, 0, 1}); }, x);
    GRADCHECK([](const TensorList& t) { return transpose(t[0], 0, 2); }, x);
    GRADCHECK([n](const TensorList& t) { return narrow(t[0], 1, n / 2, n - n / 2); }, x);
    GRADCHECK([](const TensorList& t) { return slice(t[0], 1, 0, 1000, 2); }, x);
    GRADCHECK([](const TensorList& t) { return select(t[0], 2, 1); }, x);
    GRADCHECK([n](const TensorList& t) { return expand(t[0], {4, 2, n, 3}); }, x);
    GRADCHECK([](const TensorList& t) { return unsqueeze(squeeze(unsqueeze(t[0], 1), 1), 0); }, x);
    GRADCHECK([](const TensorList& t) { return flatten(contiguous(transpose(t[0], 0, 1)), 1); }, x);
    GRADCHECK([](const TensorList& t) { return cat({t[0], t[1]}, 1); }, x, rnd({2, 5, 3}, 1));
    GRADCHECK([](const TensorList& t) { return stack({t[0], t[1]}, 2); }, x, rnd({2, n, 3}, 2));
    GRADCHECK(
        [](const TensorList& t) {
          auto parts = chunk(t[0], 4, 1);  // every part, each with its own weight
          Tensor out = parts[0] * 2.0;
          for (size_t i = 1; i < parts.size(); ++i)
            out = cat({out, parts[i] * static_cast<double>(i + 2)}, 1);
          return out;
        },
        x);
    // Only the first part used: the others' gradients are zero-filled.
    GRADCHECK([](const TensorList& t) { return split(t[0], 2, 1)[0] * 3.0; }, x);
  }
}

TEST_CASE("gradcheck: reductions", "[gradcheck]") {
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    Tensor x = rnd({3, n}, n + 1);
    GRADCHECK([](const TensorList& t) { return sum(t[0]); }, x);
    GRADCHECK([](const TensorList& t) { return sum(t[0], {0}); }, x);
    GRADCHECK([](const TensorList& t) { return mean(t[0], {1}, true); }, x);
    if (n > 1) GRADCHECK([](const TensorList& t) { return var(t[0], {1}); }, x);
    GRADCHECK([](const TensorList& t) { return max(t[0], 1).first; }, x);
    GRADCHECK([](const TensorList& t) { return max(t[0], 0, true).first; }, x);
  }
}

TEST_CASE("gradcheck: matmul and linear", "[gradcheck]") {
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    int64_t k = n > 17 ? 5 : n;
    GRADCHECK([](const TensorList& t) { return matmul(t[0], t[1]); }, rnd({3, k}, 1), rnd({k, n}, 2));
    GRADCHECK([](const TensorList& t) { return matmul(t[0], t[1]); }, rnd({2, 1, 3, k}, 3), rnd({4, k, 2}, 4));
    GRADCHECK([](const TensorList& t) { return matmul(t[0], t[1]); }, rnd({k}, 5), rnd({k, 3}, 6));
    GRADCHECK([](const TensorList& t) { return matmul(t[0], t[1]); }, rnd({2, 3, k}, 7), rnd({k}, 8));
    GRADCHECK([](const TensorList& t) { return linear(t[0], t[1], t[2]); }, rnd({2, 3, k}, 9),
              rnd({4, k}, 10), rnd({4}, 11));
    GRADCHECK([](const TensorList& t) { return linear(t[0], t[1]); }, rnd({n, 3}, 12), rnd({2, 3}, 13));
  }
}

TEST_CASE("gradcheck: softmax, norms, embedding, cross-entropy", "[gradcheck]") {
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    Tensor x = rnd({3, n}, n);
    GRADCHECK([](const TensorList& t) { return softmax(t[0], -1); }, x);
    GRADCHECK([](const TensorList& t) { return softmax(t[0], 0); }, x);
    GRADCHECK([](const TensorList& t) { return log_softmax(t[0], 1); }, x);
    GRADCHECK([](const TensorList& t) { return layer_norm(t[0], t[1], t[2]); }, x, rnd({n}, 1),
              rnd({n}, 2));
    GRADCHECK([](const TensorList& t) { return layer_norm(t[0], Tensor(), Tensor()); }, x);
    GRADCHECK([](const TensorList& t) { return rms_norm(t[0], t[1]); }, x, rnd({n}, 3));
    Tensor idx = randint({2, n}, 0, 7, n);
    GRADCHECK([idx](const TensorList& t) { return embedding(t[0], idx); }, rnd({7, 3}, 4));
    Tensor target = randint({n}, 0, 5, n + 3);
    GRADCHECK([target](const TensorList& t) { return cross_entropy(t[0], target); }, rnd({n, 5}, 5));
    // With ignored targets.
    std::vector<int64_t> tv = target.to_vector<int64_t>();
    tv[0] = -100;
    Tensor target2 = from_vector(tv, {n});
    GRADCHECK([target2](const TensorList& t) { return cross_entropy(t[0], target2); }, rnd({n, 5}, 6));
  }
}

TEST_CASE("gradcheck: attention (causal, full, grouped-query) and rope", "[gradcheck]") {
  for (int64_t t : {1, 3, 17, 70}) {
    INFO("T=" << t);
    Tensor q = rnd({1, 2, t, 4}, 1), k = rnd({1, 2, t, 4}, 2), v = rnd({1, 2, t, 4}, 3);
    GRADCHECK([](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); }, q, k, v);
    GRADCHECK([](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2], false); }, q, k, v);
    Tensor k1 = rnd({1, 1, t, 4}, 4), v1 = rnd({1, 1, t, 4}, 5);
    GRADCHECK([](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); }, q, k1, v1);
    Tensor cs = rnd({t, 2}, 6), sn = rnd({t, 2}, 7);
    GRADCHECK([cs, sn](const TensorList& x) { return rope(x[0], cs, sn); }, q);
  }
}

TEST_CASE("gradcheck: attention with an explicit scale", "[gradcheck][attention]") {
  for (int64_t t : {1, 3, 17}) {
    INFO("T=" << t);
    Tensor q = rnd({1, 2, t, 4}, 11), k = rnd({1, 2, t, 4}, 12), v = rnd({1, 2, t, 4}, 13);
    GRADCHECK(
        [](const TensorList& x) {
          return scaled_dot_product_attention(x[0], x[1], x[2], true, 0.7);
        },
        q, k, v);
    GRADCHECK(
        [](const TensorList& x) {
          return scaled_dot_product_attention(x[0], x[1], x[2], false, 1.3);
        },
        q, k, v);
    Tensor k1 = rnd({1, 1, t, 4}, 14), v1 = rnd({1, 1, t, 4}, 15);
    GRADCHECK(
        [](const TensorList& x) {
          return scaled_dot_product_attention(x[0], x[1], x[2], false, 0.45);
        },
        q, k1, v1);
  }
}

namespace {
// Attention from differentiable primitives: k/v heads repeated for grouped-query
// attention (query head h reads kv head h / (H / Hkv)), the score matrix
// materialised, future keys masked.
Tensor primitive_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                           double scale) {
  int64_t b = q.size(0), h = q.size(1), t = q.size(2), hkv = k.size(1), s = k.size(2),
          d = q.size(3);
  auto repeat_kv = [&](const Tensor& x) {
    return reshape(expand(unsqueeze(x, 2), {b, hkv, h / hkv, s, d}), {b, h, s, d});
  };
  Tensor scores = matmul(q, transpose(repeat_kv(k), -2, -1)) * scale;
  if (causal) {
    Tensor future = ops::binary(ops::BinaryOp::Gt, ops::reshape(arange(0, s), {1, s}),
                                ops::reshape(arange(0, t), {t, 1}));
    scores = where(future, full({}, -1e30, scores.dtype()), scores);
  }
  return matmul(softmax(scores, -1), repeat_kv(v));
}
}  // namespace

// Central differences at T = 257 would take minutes; instead the fused backward is
// compared with autograd through the primitive attention (itself gradient-checked
// by the matmul/softmax/where checks above).
TEST_CASE("attention backward equals autograd through the primitive attention at long T",
          "[gradcheck][attention]") {
  for (int64_t t : {129, 257}) {
    for (bool causal : {true, false}) {
      for (int64_t hkv : {4, 2, 1}) {
        // An explicit scale in half the cases (0: the default 1/sqrt(D)), both in each (T, causal).
        double scale = (hkv == 2) == causal ? 0.3 : 0.0;
        INFO("T=" << t << " causal=" << causal << " kv heads=" << hkv << " scale=" << scale);
        Tensor q = rnd({1, 4, t, 8}, static_cast<uint64_t>(t + hkv)), k = rnd({1, hkv, t, 8}, 2),
               v = rnd({1, hkv, t, 8}, 3);
        Tensor w = rnd({1, 4, t, 8}, 4);  // L = sum(out * w): a random output gradient
        auto grads = [&](bool fused, DType dt) {
          TensorList leaves;
          for (const Tensor& x : {q, k, v}) {
            Tensor l = ops::to(x, dt);
            if (l.is_same(x)) l = ops::clone(x);
            l.set_requires_grad(true);
            leaves.push_back(l);
          }
          std::optional<double> given = scale == 0.0 ? std::nullopt : std::optional<double>(scale);
          Tensor out =
              fused ? scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], causal, given)
                    : primitive_attention(leaves[0], leaves[1], leaves[2], causal,
                                          given.value_or(1.0 / std::sqrt(8.0)));
          autograd::backward(sum(mul(out, ops::to(w, dt))));
          return TensorList{ops::to(out, DType::F64), ops::to(leaves[0].grad(), DType::F64),
                            ops::to(leaves[1].grad(), DType::F64),
                            ops::to(leaves[2].grad(), DType::F64)};
        };
        TensorList ref = grads(false, DType::F64);
        TensorList ours = grads(true, DType::F64);
        TensorList ours32 = grads(true, DType::F32);
        const char* names[] = {"out", "dq", "dk", "dv"};
        for (size_t i = 0; i < 4; ++i) {
          INFO(names[i]);
          CHECK_CLOSE(ours[i], ref[i], 1e-10, 1e-12);
          CHECK_CLOSE(ours32[i], ref[i], 1e-4, 1e-5);
        }
      }
    }
  }
}

namespace {
// sin whose recorded backward is cos(x) * factor: right for factor 1 only. With
// `drop_second`, a second input y is added and its gradient never returned.
Tensor sin_with_backward(const Tensor& x, double factor, const Tensor& y = {}) {
  Tensor out = ops::unary(ops::UnaryOp::Sin, x);
  if (y.defined()) out = ops::add(out, y);
  TensorList inputs = y.defined() ? TensorList{x, y} : TensorList{x};
  if (autograd::should_record(inputs))
    autograd::record(
        "test_sin", inputs, {out}, [x, factor, two = y.defined()](const TensorList& g) {
          Tensor gx = ops::mul(ops::mul(g[0], ops::unary(ops::UnaryOp::Cos, x)), factor);
          return two ? TensorList{gx, Tensor()} : TensorList{gx};
        });
  return out;
}
}  // namespace

TEST_CASE("gradcheck fails for a wrong backward and says where", "[gradcheck]") {
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    Tensor x = rnd({n}, n), y = rnd({n}, n + 1);
    // The right backward passes (so a failure below is the backward's fault).
    auto good = check_grads([](const TensorList& t) { return sin_with_backward(t[0], 1.0); }, x);
    INFO(good.message);
    CHECK(good.ok);
    // Off by 0.1%: beyond gradcheck's rtol of 1e-4.
    auto bad = check_grads([](const TensorList& t) { return sin_with_backward(t[0], 1.001); }, x);
    CHECK_FALSE(bad.ok);
    CHECK(bad.max_error > 1.0);
    CHECK_THAT(bad.message, Catch::Contains("input 0 element"));
    // A sign error.
    CHECK_FALSE(
        check_grads([](const TensorList& t) { return sin_with_backward(t[0], -1.0); }, x).ok);
    // A missing gradient for the second input.
    auto missing =
        check_grads([](const TensorList& t) { return sin_with_backward(t[0], 1.0, t[1]); }, x, y);
    CHECK_FALSE(missing.ok);
    CHECK_THAT(missing.message, Catch::Contains("input 1 element"));
  }
}

TEST_CASE("swiglu: central differences, and the bits of silu then mul in every dtype and on async_cpu", "[gradcheck][swiglu]") {
  for (int64_t n : kSizes)
    GRADCHECK([](const TensorList& x) { return swiglu(x[0], x[1]); }, rnd({n, 3}, 70 + n), rnd({n, 3}, 80 + n));
  for (DType dtype : {DType::F32, DType::F64, DType::BF16, DType::F16})
    for (Device device : {Device::cpu(), Device::async_cpu()})
      for (Shape shape : {Shape{1}, Shape{17, 3}, Shape{5, 40001}}) {  // the last crosses the threads' pieces
        INFO(dtype_name(dtype) << " " << device.str() << " " << shape_str(shape));
        auto make = [&](uint64_t seed) {
          Tensor t = ops::to(ops::mul(randn(shape, seed), 3.0), dtype).to(device);
          t.set_requires_grad(true);
          return t;
        };
        Tensor g1 = make(1), u1 = make(2), g2 = make(1), u2 = make(2);
        Tensor grad = ops::to(randn(shape, 3), dtype).to(device);
        Tensor fused = swiglu(g1, u1), unfused = silu(g2) * u2;
        autograd::backward({fused, unfused}, {grad, grad});
        auto host = [](const Tensor& t) { return t.to(Device::cpu()); };
        CHECK(testing::equal(host(fused), host(unfused)));
        CHECK(testing::equal(host(g1.grad()), host(g2.grad())));
        CHECK(testing::equal(host(u1.grad()), host(u2.grad())));
      }
  CHECK_THROWS_WITH(swiglu(randn({2, 3}, 1), randn({3, 2}, 2)), Catch::Contains("swiglu: gate") &&
                                                                      Catch::Contains("differ"));
  CHECK_THROWS_WITH(swiglu(zeros({2}, DType::I64), zeros({2}, DType::I64)),
                    Catch::Contains("swiglu: expected floating-point tensors, got i64"));
}

TEST_CASE("add_layer_norm, add_rms_norm: central differences; the bits of add then the norm, forward and "
          "backward, in every dtype and on async_cpu", "[gradcheck][add_norm]") {
  // Both outputs feed the loss, as in a block (the sum goes on down the
  // residual stream): the sum's gradient is the later ops' plus the norm's.
  auto both = [](const std::pair<Tensor, Tensor>& r) { return sum(r.first * r.first) + sum(r.second); };
  for (int64_t n : kSizes) {
    INFO("n=" << n);
    Tensor x = rnd({3, n}, 60 + n), res = rnd({3, n}, 61 + n), w = rnd({n}, 62 + n), b = rnd({n}, 63 + n);
    GRADCHECK([&](const TensorList& t) { return both(add_layer_norm(t[0], t[1], t[2], t[3])); }, x, res, w, b);
    GRADCHECK([&](const TensorList& t) { return both(add_layer_norm(t[0], t[1], Tensor(), Tensor())); }, x, res);
    GRADCHECK([&](const TensorList& t) { return both(add_rms_norm(t[0], t[1], t[2])); }, x, res, w);
  }
  // The fused kernel against add, then the norm, bit for bit: one element,
  // one column, rows that cross the threads' pieces, uneven rows, no rows,
  // with and without weight and bias, a transposed (strided) input.
  for (DType dtype : {DType::F32, DType::F64, DType::BF16, DType::F16})
    for (Device device : {Device::cpu(), Device::async_cpu()})
      for (Shape shape : {Shape{1}, Shape{3, 1}, Shape{17, 3}, Shape{2, 600, 257}, Shape{520, 300}, Shape{0, 6}})
        for (int form : {0, 1, 2, 3}) {  // layer norm with weight and bias, without either, without bias; RMS
          const bool rms = form == 3, strided = shape.size() == 2 && shape[0] == 17;
          INFO(dtype_name(dtype) << " " << device.str() << " " << shape_str(shape) << " form " << form);
          const int64_t c = shape.back();
          auto make = [&](const Shape& s, uint64_t seed, double scale, bool grad) {
            Tensor t = ops::to(ops::add(ops::mul(randn(s, seed), scale), 0.25), dtype).to(device);
            t.set_requires_grad(grad);
            return t;
          };
          auto leaves = [&] {
            Tensor x = make(shape, 1, 3.0, true), r = make(shape, 2, 1.5, true);
            if (strided) x = autograd::detach(ops::transpose(ops::contiguous(ops::transpose(x, 0, 1)), 0, 1));
            x.set_requires_grad(true);
            Tensor w = form == 1 ? Tensor() : make({c}, 3, 1.0, true);
            Tensor b = form == 0 ? make({c}, 4, 0.5, true) : Tensor();
            return TensorList{x, r, w, b};
          };
          TensorList f = leaves(), u = leaves();
          if (strided) CHECK_FALSE(f[0].is_contiguous());
          Tensor gs = ops::to(randn(shape, 5), dtype).to(device), gy = ops::to(randn(shape, 6), dtype).to(device);
          auto [fsum, fy] = rms ? add_rms_norm(f[0], f[1], f[2], 1e-5) : add_layer_norm(f[0], f[1], f[2], f[3], 1e-5);
          Tensor usum = u[0] + u[1];
          Tensor uy = rms ? rms_norm(usum, u[2], 1e-5) : layer_norm(usum, u[2], u[3], 1e-5);
          autograd::backward({fsum, fy, usum, uy}, {gs, gy, gs, gy});
          auto host = [](const Tensor& t) { return t.to(Device::cpu()); };
          CHECK(testing::equal(host(fsum), host(usum)));
          CHECK(testing::equal(host(fy), host(uy)));
          for (int i = 0; i < 4; ++i) {
            INFO("gradient of input " << i);
            REQUIRE(f[i].defined() == u[i].defined());
            if (f[i].defined()) CHECK(testing::equal(host(f[i].grad()), host(u[i].grad())));
          }
        }
  // The ops layer's results: the statistics as the norm's, in f32 for bf16.
  Tensor x = ops::to(randn({9, 33}, 7), DType::BF16), r = ops::to(randn({9, 33}, 8), DType::BF16);
  ops::AddNormResult a = ops::add_layer_norm(x, r, Tensor(), Tensor(), 1e-5);
  ops::NormResult n = ops::layer_norm(ops::add(x, r), Tensor(), Tensor(), 1e-5);
  CHECK(a.norm.mean.dtype() == DType::F32);
  CHECK(testing::equal(a.norm.mean, n.mean));
  CHECK(testing::equal(a.norm.rstd, n.rstd));
  CHECK_FALSE(ops::add_rms_norm(x, r, Tensor(), 1e-5).norm.mean.defined());
  CHECK_THROWS_WITH(add_layer_norm(randn({2, 3}, 1), randn({3, 3}, 2), Tensor(), Tensor()),
                    Catch::Contains("add_layer_norm: residual [3, 3] is not shaped as input [2, 3]"));
  CHECK_THROWS_WITH(add_rms_norm(randn({2, 3}, 1), randn({2, 3}, 2, DType::F64), Tensor()),
                    Catch::Contains("add_rms_norm: dtype mismatch (f32 and f64)"));
  CHECK_THROWS_WITH(add_layer_norm(randn({2, 3}, 1), randn({2, 3}, 2), randn({2}, 3), Tensor()),
                    Catch::Contains("add_layer_norm: weight/bias shape [2] does not match normalised size 3"));
  CHECK_THROWS_WITH(add_layer_norm(zeros({2}, DType::I64), zeros({2}, DType::I64), Tensor(), Tensor()),
                    Catch::Contains("add_layer_norm: input must be floating-point, got i64"));
}

TEST_CASE("linear_gelu: central differences; the fused bias and GELU give add then gelu's bits, and sum's bias "
          "gradient, in every dtype and on async_cpu", "[gradcheck][linear_gelu]") {
  for (int64_t n : kSizes)
    for (bool tanh_form : {false, true})
      GRADCHECK([tanh_form](const TensorList& x) { return linear_gelu(x[0], x[1], x[2], tanh_form); },
                rnd({2, n, 4}, 90 + n), rnd({5, 4}, 91 + n), rnd({5}, 92 + n));
  // The fused kernels against add, gelu, gelu's backward and sum, bit for bit:
  // one row, one column, uneven column blocks, rows cut into 4 parts for the
  // bias sum (1100 and 1200 rows), more than 16 column blocks, no rows.
  for (DType dtype : {DType::F32, DType::F64, DType::BF16, DType::F16})
    for (Device device : {Device::cpu(), Device::async_cpu()})
      for (Shape shape : {Shape{5}, Shape{3, 1}, Shape{17, 3}, Shape{7, 300}, Shape{1100, 300}, Shape{2, 600, 257},
                          Shape{520, 4200}, Shape{0, 6}})
        for (bool tanh_form : {false, true}) {
          INFO(dtype_name(dtype) << " " << device.str() << " " << shape_str(shape) << " tanh " << tanh_form);
          auto make = [&](const Shape& s, uint64_t seed, double scale) {
            return ops::to(ops::mul(randn(s, seed), scale), dtype).to(device);
          };
          Tensor x = make(shape, 1, 2.0), bias = make({shape.back()}, 2, 1.0), grad = make(shape, 3, 1.0);
          const auto op = tanh_form ? ops::UnaryOp::GeluTanh : ops::UnaryOp::Gelu;
          std::vector<int64_t> rows(shape.size() - 1);
          std::iota(rows.begin(), rows.end(), 0);
          Tensor z = ops::add(x, bias);
          Tensor gx = ops::unary_backward(op, grad, z, Tensor());
          TensorList fused = ops::bias_gelu_backward(grad, x, bias, tanh_form);
          auto host = [](const Tensor& t) { return t.to(Device::cpu()); };
          CHECK(testing::equal(host(ops::bias_gelu(x, bias, tanh_form)), host(ops::unary(op, z))));
          CHECK(testing::equal(host(fused[0]), host(gx)));
          CHECK(testing::equal(host(fused[1]), host(rows.empty() ? gx : ops::sum(gx, rows))));
          CHECK(fused[1].dtype() == dtype);
        }
  CHECK_THROWS_WITH(ops::bias_gelu(randn({2, 3}, 1), randn({2}, 2), false),
                    Catch::Contains("bias_gelu: bias [2] does not match the last dim of input [2, 3] (expected [3])"));
  CHECK_THROWS_WITH(ops::bias_gelu(zeros({2}, DType::I64), zeros({2}, DType::I64), false),
                    Catch::Contains("bias_gelu: expected a floating-point input, got i64"));
  CHECK_THROWS_WITH(ops::bias_gelu(randn({2, 3}, 1), randn({3}, 2, DType::F64), false),
                    Catch::Contains("bias_gelu: dtype mismatch (f32 and f64)"));
  CHECK_THROWS_WITH(ops::bias_gelu_backward(randn({3, 3}, 1), randn({2, 3}, 2), randn({3}, 3), false),
                    Catch::Contains("bias_gelu_backward: gradient") && Catch::Contains("is not laid out as input"));
}

TEST_CASE("linear_gelu against linear then gelu: the same numbers to rounding, a split backward's bits, and a "
          "Linear with an activation", "[linear_gelu]") {
  // The unfused bias goes into the product's accumulation, the fused one is
  // added to the rounded product: equal to within the dtype's rounding.
  for (DType dtype : {DType::F64, DType::F32, DType::BF16}) {
    INFO(dtype_name(dtype));
    const double tol = dtype == DType::F64 ? 1e-13 : dtype == DType::F32 ? 1e-5 : 1.0 / 64;
    auto make = [&](const Shape& s, uint64_t seed) {
      Tensor t = ops::to(randn(s, seed), dtype);
      t.set_requires_grad(true);
      return t;
    };
    Tensor x1 = make({3, 37, 29}, 4), w1 = make({131, 29}, 5), b1 = make({131}, 6);
    Tensor x2 = make({3, 37, 29}, 4), w2 = make({131, 29}, 5), b2 = make({131}, 6);
    Tensor grad = ops::to(randn({3, 37, 131}, 7), dtype);
    Tensor fused = linear_gelu(x1, w1, b1), unfused = gelu(linear(x2, w2, b2));
    autograd::backward({fused, unfused}, {grad, grad});
    // Within tol of the largest magnitude: a 16-bit gradient summed over the
    // rows rounds each partial sum at its own scale.
    auto check_close = [&](const Tensor& a, const Tensor& b) {
      double top = 0;
      for (double v : b.to_vector<double>()) top = std::max(top, std::fabs(v));
      INFO("max |diff| " << testing::max_abs_diff(a, b) << ", max |value| " << top);
      CHECK(testing::max_abs_diff(a, b) <= tol * std::max(top, 1.0));
    };
    // bf16 takes the unfused path (measured faster): the same bits.
    if (dtype == DType::BF16) CHECK(testing::equal(fused, unfused));
    check_close(fused, unfused);
    check_close(x1.grad(), x2.grad());
    check_close(w1.grad(), w2.grad());
    check_close(b1.grad(), b2.grad());
  }
  // A split backward (zero-bubble pipelines): input gradient first, weight and
  // bias later, the bits of one backward.
  Tensor x = randn({9, 33}, 8), w = randn({70, 33}, 9), b = randn({70}, 10), grad = randn({9, 70}, 11);
  for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
  autograd::backward(linear_gelu(x, w, b, true), grad);
  Tensor gx = x.grad(), gw = w.grad(), gb = b.grad();
  Tensor xs = autograd::detach(x), ws = autograd::detach(w), bs = autograd::detach(b);
  for (Tensor* t : {&xs, &ws, &bs}) t->set_requires_grad(true);
  auto deferred = autograd::backward_input({linear_gelu(xs, ws, bs, true)}, {grad}, {xs});
  CHECK(testing::equal(xs.grad(), gx));
  CHECK_FALSE(ws.grad().defined());
  autograd::backward_weight(*deferred);
  CHECK(testing::equal(ws.grad(), gw));
  CHECK(testing::equal(bs.grad(), gb));
  // nn::Linear applies its activation in its own call; without a bias it is
  // gelu of the product.
  for (bool with_bias : {true, false}) {
    nn::Linear fc(33, 70, with_bias);
    fc.activation = nn::Activation::GeluTanh;
    Tensor y = fc(x);
    Tensor expect = with_bias ? linear_gelu(x, fc.weight, fc.bias, true) : gelu(linear(x, fc.weight), true);
    CHECK(testing::equal(y, expect));
    fc.activation = nn::Activation::None;
    CHECK(testing::equal(fc(x), linear(x, fc.weight, fc.bias)));
  }
  // The backward holds no more than the unfused ops' but the bias gradient
  // (made before the product's backward, not after): GELU's input and its
  // incoming gradient go before the product's backward runs (one node
  // holding them through it planned 7.2 MiB more for the default model).
  auto backward_peak = [](bool fused) {
    Tensor xm = randn({509, 256}, 12), wm = randn({1021, 256}, 13), bm = randn({1021}, 14);
    for (Tensor* t : {&xm, &wm, &bm}) t->set_requires_grad(true);
    Tensor y = fused ? linear_gelu(xm, wm, bm) : gelu(linear(xm, wm, bm));
    Tensor g = randn(y.shape(), 15);
    reset_peak_memory_stats();
    const int64_t base = memory_stats().allocated_bytes;
    autograd::backward(y, g);
    return memory_stats().peak_allocated_bytes - base;
  };
  const int64_t fused_peak = backward_peak(true), unfused_peak = backward_peak(false);
  INFO("backward peak fused " << fused_peak << " B, unfused " << unfused_peak << " B");
  CHECK(fused_peak <= unfused_peak + 1021 * static_cast<int64_t>(sizeof(float)));
}
