// Every differentiable op against central differences in f64, at awkward sizes.
#include "autograd/functions.h"
#include "autograd/gradcheck.h"
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
