// Fused kernels against references built from simpler ops, in f32 at awkward
// sizes (the f64 gradient checks live in tests/autograd).
#include <cmath>

#include "runtime/allocator.h"
#include "tests/helpers.h"

using namespace tessera;
using ops::BinaryOp;

TEST_CASE("attention matches the materialised reference", "[kernels][attention]") {
  for (int64_t t : {1, 17, 64, 65, 130, 257}) {
    for (bool causal : {true, false}) {
      for (int64_t hkv : {4, 2, 1}) {
        INFO("T=" << t << " causal=" << causal << " kv heads=" << hkv);
        Tensor q = randn({2, 4, t, 16}, 1), k = randn({2, hkv, t, 16}, 2), v = randn({2, hkv, t, 16}, 3);
        double scale = 0.25;
        Tensor ours = ops::attention(q, k, v, causal, scale).out;
        Tensor ref = ops::attention_reference(q, k, v, causal, scale);
        CHECK_CLOSE(ours, ref, 1e-4, 1e-5);
      }
    }
  }
  // bf16 inputs are computed in f32 and rounded once.
  Tensor q = randn({1, 2, 33, 8}, 4), k = randn({1, 2, 33, 8}, 5), v = randn({1, 2, 33, 8}, 6);
  Tensor b = ops::attention(ops::to(q, DType::BF16), ops::to(k, DType::BF16), ops::to(v, DType::BF16), true, 0.3).out;
  CHECK(b.dtype() == DType::BF16);
  Tensor ref = ops::attention_reference(ops::to(ops::to(q, DType::BF16), DType::F32),
                                        ops::to(ops::to(k, DType::BF16), DType::F32),
                                        ops::to(ops::to(v, DType::BF16), DType::F32), true, 0.3);
  CHECK_CLOSE(ops::to(b, DType::F32), ref, 1e-2, 1e-2);  // within bf16 rounding
}

TEST_CASE("attention never materialises the score matrix", "[kernels][attention][memory]") {
  int64_t t = 2048;
  Tensor q = randn({1, 1, t, 16}, 1), k = randn({1, 1, t, 16}, 2), v = randn({1, 1, t, 16}, 3);
  int64_t scores_bytes = t * t * 4;
  reset_peak_memory_stats();
  int64_t base = memory_stats().current_bytes;
  auto r = ops::attention(q, k, v, true, 0.25);
  int64_t ours = memory_stats().peak_bytes - base;
  auto g = ops::attention_backward(ones(r.out.shape()), q, k, v, r.out, r.lse, true, 0.25);
  int64_t ours_bwd = memory_stats().peak_bytes - base;
  reset_peak_memory_stats();
  base = memory_stats().current_bytes;
  Tensor ref = ops::attention_reference(q, k, v, true, 0.25);
  int64_t reference = memory_stats().peak_bytes - base;
  INFO("forward peak " << ours << " B, with backward " << ours_bwd << " B, reference " << reference
                       << " B, one score matrix " << scores_bytes << " B");
  CHECK(ours < scores_bytes / 16);
  CHECK(ours_bwd < scores_bytes / 8);
  CHECK(reference >= scores_bytes);
}

TEST_CASE("softmax, log_softmax, layer_norm, rms_norm against compositions", "[kernels]") {
  for (int64_t n : {1, 3, 17, 257}) {
    INFO("n=" << n);
    Tensor x = ops::mul(randn({5, n}, n), 3.0);
    Tensor mx = ops::max(x, -1, true).first;
    Tensor e = ops::exp(ops::sub(x, mx));
    Tensor sm = ops::div(e, ops::sum(e, {-1}, true));
    CHECK_CLOSE(ops::softmax(x, -1), sm, 1e-5, 1e-7);
    CHECK_CLOSE(ops::log_softmax(x, 1), ops::unary(ops::UnaryOp::Log, sm), 1e-5, 1e-6);
    CHECK_CLOSE(ops::softmax(ops::transpose(x, 0, 1), 0), ops::transpose(sm, 0, 1), 1e-5, 1e-7);
    Tensor w = randn({n}, 1), b = randn({n}, 2);
    Tensor mu = ops::mean(x, {-1}, true);
    Tensor var = ops::var(x, {-1}, 0, true);
    Tensor ln = ops::add(ops::mul(ops::div(ops::sub(x, mu), ops::sqrt(ops::add(var, 1e-5))), w), b);
    CHECK_CLOSE(ops::layer_norm(x, w, b, 1e-5).y, ln, 1e-4, 1e-4);
    Tensor ms = ops::mean(ops::mul(x, x), {-1}, true);
    Tensor rms = ops::mul(ops::div(x, ops::sqrt(ops::add(ms, 1e-6))), w);
    CHECK_CLOSE(ops::rms_norm(x, w, 1e-6).y, rms, 1e-4, 1e-4);
  }
}

TEST_CASE("cross_entropy equals mean negative log-likelihood; ignore_index", "[kernels]") {
  for (int64_t c : {1, 3, 17, 257}) {
    INFO("C=" << c);
    Tensor logits = ops::mul(randn({9, c}, c), 4.0);
    std::vector<int64_t> t = randint({9}, 0, c, c + 1).to_vector<int64_t>();
    t[2] = -100;
    auto r = ops::cross_entropy(logits, from_vector(t, {9}), -100);
    CHECK(r.count == 8);
    auto lsm = ops::log_softmax(logits, -1).to_vector<double>();
    double nll = 0;
    for (int i = 0; i < 9; ++i)
      if (t[i] != -100) nll -= lsm[static_cast<size_t>(i * c + t[i])];
    CHECK(r.loss.item() == Approx(nll / 8).epsilon(1e-5));
  }
  // All ignored: 0, not NaN.
  auto r = ops::cross_entropy(randn({2, 3}, 1), from_vector<int64_t>({-1, -1}, {2}), -1);
  CHECK(r.loss.item() == 0.0);
}

TEST_CASE("elementwise math agrees with libm", "[kernels]") {
  Tensor x = ops::mul(randn({4097}, 7, DType::F64), 6.0);
  Tensor xf = ops::to(x, DType::F32);
  auto vx = x.to_vector<double>();
  struct Case {
    ops::UnaryOp op;
    double (*f)(double);
    double rtol;
  };
  std::vector<Case> cases = {
      {ops::UnaryOp::Exp, [](double v) { return std::exp(v); }, 2e-6},
      {ops::UnaryOp::Tanh, [](double v) { return std::tanh(v); }, 2e-6},
      {ops::UnaryOp::Sigmoid, [](double v) { return 1 / (1 + std::exp(-v)); }, 2e-6},
      {ops::UnaryOp::Gelu, [](double v) { return 0.5 * v * std::erfc(-v / std::sqrt(2.0)); }, 1e-5},
      {ops::UnaryOp::Silu, [](double v) { return v / (1 + std::exp(-v)); }, 2e-6},
  };
  for (auto& c : cases) {
    INFO(ops::unary_name(c.op));
    std::vector<double> ref(vx.size());
    for (size_t i = 0; i < vx.size(); ++i) ref[i] = c.f(static_cast<double>(static_cast<float>(vx[i])));
    CHECK_CLOSE(ops::unary(c.op, xf), from_vector(ref, {4097}), c.rtol, 1e-30);
  }
  // exp at the ends of the float range.
  Tensor edge = from_vector<float>({-200.f, -100.f, -87.5f, 0.f, 88.7f, 89.f, NAN}, {7});
  auto e = ops::unary(ops::UnaryOp::Exp, edge).to_vector<double>();
  auto ref = [](float v) { return std::exp(static_cast<double>(v)); };
  CHECK(e[0] == 0.0);
  CHECK(e[1] == Approx(ref(-100.f)).margin(2e-45));  // denormal: within one denormal step
  CHECK(e[2] == Approx(ref(-87.5f)).epsilon(1e-6));
  CHECK(e[3] == 1.0);
  CHECK(e[4] == Approx(ref(88.7f)).epsilon(1e-6));
  CHECK(std::isinf(e[5]));
  CHECK(std::isnan(e[6]));
}
