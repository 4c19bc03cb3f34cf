// Fused kernels against references built from simpler ops, in f32 at awkward
// sizes (the f64 gradient checks live in tests/autograd).
#include <cmath>

#include "runtime/allocator.h"
#include "runtime/cpu/kernels_cpu.h"
#include "runtime/parallel.h"
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

TEST_CASE("attention in f32 against the f64 kernel, forward and backward, at awkward head sizes",
          "[kernels][attention]") {
  // Head sizes no vector width divides, a last block of queries or keys
  // short, keys longer or shorter than queries, grouped heads, and a head
  // wider than 256; each against the f64 kernel on the same values.
  auto f64 = [](const Tensor& t) { return ops::to(t, DType::F64); };
  for (auto [t, s, d, hkv] : {std::tuple{1, 1, 8, 2}, {65, 65, 24, 1}, {130, 77, 72, 2}, {63, 200, 100, 1},
                              {129, 129, 264, 2}}) {
    for (bool causal : {true, false}) {
      INFO("T=" << t << " S=" << s << " head_dim=" << d << " kv heads=" << hkv << " causal=" << causal);
      Tensor q = randn({2, 2, t, d}, 1), k = randn({2, hkv, s, d}, 2), v = randn({2, hkv, s, d}, 3);
      Tensor dout = randn({2, 2, t, d}, 4);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      ops::AttentionResult r = ops::attention(q, k, v, causal, scale);
      ops::AttentionResult r64 = ops::attention(f64(q), f64(k), f64(v), causal, scale);
      CHECK_CLOSE(f64(r.out), r64.out, 1e-4, 1e-5);
      CHECK_CLOSE(f64(r.lse), r64.lse, 1e-5, 1e-5);
      ops::AttentionGrads g = ops::attention_backward(dout, q, k, v, r.out, r.lse, causal, scale);
      ops::AttentionGrads g64 =
          ops::attention_backward(f64(dout), f64(q), f64(k), f64(v), r64.out, r64.lse, causal, scale);
      CHECK_CLOSE(f64(g.dq), g64.dq, 1e-4, 1e-5);
      CHECK_CLOSE(f64(g.dk), g64.dk, 1e-4, 1e-5);
      CHECK_CLOSE(f64(g.dv), g64.dv, 1e-4, 1e-5);
    }
  }
}

TEST_CASE("attention never materialises the score matrix", "[kernels][attention][memory]") {
  int64_t t = 2048;
  Tensor q = randn({1, 1, t, 16}, 1), k = randn({1, 1, t, 16}, 2), v = randn({1, 1, t, 16}, 3);
  int64_t scores_bytes = t * t * 4;
  reset_peak_memory_stats();
  int64_t base = memory_stats().allocated_bytes;
  auto r = ops::attention(q, k, v, true, 0.25);
  int64_t ours = memory_stats().peak_allocated_bytes - base;
  auto g = ops::attention_backward(ones(r.out.shape()), q, k, v, r.out, r.lse, true, 0.25);
  int64_t ours_bwd = memory_stats().peak_allocated_bytes - base;
  reset_peak_memory_stats();
  base = memory_stats().allocated_bytes;
  Tensor ref = ops::attention_reference(q, k, v, true, 0.25);
  int64_t reference = memory_stats().peak_allocated_bytes - base;
  INFO("forward peak " << ours << " B, with backward " << ours_bwd << " B, reference " << reference
                       << " B, one score matrix " << scores_bytes << " B");
  CHECK(ours < scores_bytes / 16);
  CHECK(ours_bwd < scores_bytes / 8);
  CHECK(reference >= scores_bytes);
}

TEST_CASE("attention reads q, k and v where they lie: a projection's heads give the bits of contiguous copies, "
          "with no copy made", "[kernels][attention][memory]") {
  // [B, L, width] -> the heads of columns [at, at + heads * d) as [B, heads, L, d]: a view, rows `width` apart.
  auto heads_of = [](const Tensor& proj, int64_t at, int64_t heads, int64_t d) {
    Tensor part = ops::narrow(proj, 2, at, heads * d);
    return ops::transpose(ops::view(part, {proj.size(0), proj.size(1), heads, d}), 1, 2);
  };
  // Bytes allocated at the peak of f() above what was live before it.
  auto peak_of = [](auto&& f) {
    reset_peak_memory_stats();
    int64_t base = memory_stats().allocated_bytes;
    f();
    return memory_stats().peak_allocated_bytes - base;
  };
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    for (auto [t, s, h, hkv] : {std::tuple{1, 1, 3, 3}, {67, 67, 3, 1}, {130, 130, 4, 2}, {19, 83, 2, 1}}) {
      for (bool causal : {true, false}) {
        INFO(dtype_name(dt) << " T=" << t << " S=" << s << " heads=" << h << " kv heads=" << hkv
                            << " causal=" << causal);
        const int64_t b = 2, d = 24;
        // q from one projection (with 5 columns to spare), k and v from another, dout a transposed gradient.
        Tensor qp = ops::to(randn({b, t, h * d + 5}, 1), dt), kvp = ops::to(randn({b, s, 2 * hkv * d}, 2), dt);
        Tensor q = heads_of(qp, 0, h, d), k = heads_of(kvp, 0, hkv, d), v = heads_of(kvp, hkv * d, hkv, d);
        Tensor dout = ops::transpose(ops::to(randn({b, t, h, d}, 3), dt), 1, 2);
        REQUIRE(!q.is_contiguous());
        Tensor qc = ops::contiguous(q), kc = ops::contiguous(k), vc = ops::contiguous(v);
        Tensor dc = ops::contiguous(dout);
        ops::AttentionResult r, rc;
        int64_t peak = peak_of([&] { r = ops::attention(q, k, v, causal, 0.2); });
        int64_t peak_c = peak_of([&] { rc = ops::attention(qc, kc, vc, causal, 0.2); });
        CHECK(testing::equal(r.out, rc.out));
        CHECK(testing::equal(r.lse, rc.lse));
        CHECK(peak == peak_c);  // no copy of q, k or v
        // out lies as [B, T, H, D]: merging the heads back is a view.
        CHECK(ops::transpose(r.out, 1, 2).is_contiguous());
        ops::AttentionGrads g, gc;
        Tensor oc = ops::contiguous(rc.out);
        int64_t bpeak = peak_of([&] { g = ops::attention_backward(dout, q, k, v, r.out, r.lse, causal, 0.2); });
        int64_t bpeak_c = peak_of([&] { gc = ops::attention_backward(dc, qc, kc, vc, oc, rc.lse, causal, 0.2); });
        CHECK(testing::equal(g.dq, gc.dq));
        CHECK(testing::equal(g.dk, gc.dk));
        CHECK(testing::equal(g.dv, gc.dv));
        CHECK(bpeak == bpeak_c);
        // Each gradient lies as its input: a projection's heads' as [B, T, H, D]
        // (the gradient of the projection is then a view), a contiguous input's contiguous.
        for (const Tensor* x : {&g.dq, &g.dk, &g.dv})
          CHECK((x->size(1) == 1 || ops::transpose(*x, 1, 2).is_contiguous()));
        CHECK(gc.dq.is_contiguous());
        CHECK(gc.dk.is_contiguous());
      }
    }
  }
  // Operands the kernels cannot read in place (head_dim strided, tokens
  // broadcast) are copied first, and give the same bits.
  Tensor q = randn({2, 3, 9, 8}, 4), k = randn({2, 3, 1, 8}, 5), v = randn({2, 3, 9, 8}, 6);
  Tensor q_strided = ops::transpose(ops::contiguous(ops::transpose(q, 2, 3)), 2, 3);
  Tensor k_broadcast = ops::expand(k, {2, 3, 9, 8});
  REQUIRE(q_strided.stride(3) != 1);
  REQUIRE(k_broadcast.stride(2) == 0);
  ops::AttentionResult r = ops::attention(q_strided, k_broadcast, v, true, 0.3);
  ops::AttentionResult rc = ops::attention(q, ops::contiguous(k_broadcast), v, true, 0.3);
  CHECK(testing::equal(r.out, rc.out));
  CHECK(testing::equal(r.lse, rc.lse));
}

TEST_CASE("a bf16 embedding's gradient is summed in f32: a frequent token's row keeps growing", "[kernels]") {
  // 4096 of 4099 tokens are token 5; each adds 1 (and 0.5) to its row. Summed
  // in bf16 the row would stop at 256 (256 + 1 rounds back to 256).
  std::vector<int64_t> ids(4099, 5);
  ids[7] = 0, ids[2000] = 2, ids[4098] = 0;
  Tensor idx = from_vector(ids, {4099});
  Tensor grad = ops::to(full({4099, 3}, 1.0), DType::BF16);
  Tensor gw = ops::embedding_backward(grad, idx, 6);
  CHECK(gw.dtype() == DType::BF16);
  const std::vector<double> got = ops::to(gw, DType::F64).to_vector<double>();
  CHECK(got == std::vector<double>{2, 2, 2, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 4096, 4096, 4096});
  Tensor half = ops::to(full({4099, 3}, 0.5), DType::BF16);
  CHECK(ops::to(ops::embedding_backward(half, idx, 6), DType::F64).to_vector<double>()[15] == 2048);
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
    CHECK(r.count.item() == 8);
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

TEST_CASE("GELU's tanh form keeps its digits in the negative tail, forward and backward", "[kernels]") {
  // 0.5 x (1 + tanh(u)) in f32 kept no correct digit below x = -5 (1 + tanh(u)
  // cancels). The reference writes 1 + tanh(u) = 2w / (1 + w) and 1 - tanh^2(u)
  // = 4w / (1 + w)^2 with w = e^{2u}, in f64. Down to x = -9 the results are
  // normal floats; their relative error is exp's, |2u| ulps at most.
  Tensor x = ops::add(ops::mul(rand({1031}, 5, DType::F64), -6.0), -3.0);  // [-9, -3]
  Tensor xf = ops::to(x, DType::F32);
  Tensor g = randn({1031}, 6, DType::F32);
  auto vx = xf.to_vector<double>(), vg = g.to_vector<double>();
  std::vector<double> y(vx.size()), dx(vx.size());
  const double k = std::sqrt(2 / M_PI);
  for (size_t i = 0; i < vx.size(); ++i) {
    const double v = vx[i], u = k * (v + 0.044715 * v * v * v), w = std::exp(2 * u);
    y[i] = v * w / (1 + w);
    dx[i] = vg[i] * (w / (1 + w) + v * k * (1 + 3 * 0.044715 * v * v) * 2 * w / ((1 + w) * (1 + w)));
  }
  CHECK_CLOSE(ops::unary(ops::UnaryOp::GeluTanh, xf), from_vector(y, {1031}), 2e-5, 1e-30);
  CHECK_CLOSE(ops::unary_backward(ops::UnaryOp::GeluTanh, g, xf, Tensor()), from_vector(dx, {1031}), 2e-5, 1e-30);
  // f64 to the last bits, and the ends: -0 for large negative x, x for large
  // positive x with a derivative of 1, NaN through.
  CHECK_CLOSE(ops::unary(ops::UnaryOp::GeluTanh, ops::to(xf, DType::F64)), from_vector(y, {1031}), 1e-13, 1e-300);
  Tensor ends = from_vector<float>({-200.f, -30.f, 30.f, 200.f, NAN}, {5});
  auto e = ops::unary(ops::UnaryOp::GeluTanh, ends).to_vector<double>();
  auto d = ops::unary_backward(ops::UnaryOp::GeluTanh, ones({5}), ends, Tensor()).to_vector<double>();
  CHECK((e[0] == 0.0 && std::signbit(e[0])));
  CHECK(e[1] == 0.0);
  CHECK((e[2] == 30.0 && e[3] == 200.0));
  CHECK(std::isnan(e[4]));
  CHECK((d[0] == 0.0 && d[1] == 0.0 && d[2] == 1.0 && d[3] == 1.0));
  CHECK(std::isnan(d[4]));
}

TEST_CASE("elementwise math agrees with libm", "[kernels]") {
  Tensor x = ops::mul(randn({4097}, 7, DType::F64), 6.0);
  Tensor xf = ops::to(x, DType::F32);
  auto vx = x.to_vector<double>();
  struct Case {
    ops::UnaryOp op;
    double (*f)(double);
    double rtol;
    double atol = 1e-30;    // for results that cancel to near 0 in f32 (sin, cos)
    bool positive = false;  // domain x > 0: evaluated at |x| + 0.01
  };
  // 0.5 v (1 + tanh(u)) as v / (1 + e^{-2u}): the same function, without the
  // cancellation that leaves the first form no correct digit in the negative
  // tail, in f64 too below v = -8.
  auto gelu_tanh = [](double v) {
    return v / (1 + std::exp(-2 * std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
  };
  std::vector<Case> cases = {
      {ops::UnaryOp::Exp, [](double v) { return std::exp(v); }, 2e-6},
      {ops::UnaryOp::Tanh, [](double v) { return std::tanh(v); }, 2e-6},
      {ops::UnaryOp::Sigmoid, [](double v) { return 1 / (1 + std::exp(-v)); }, 2e-6},
      {ops::UnaryOp::Gelu, [](double v) { return 0.5 * v * std::erfc(-v / std::sqrt(2.0)); }, 1e-5},
      {ops::UnaryOp::Silu, [](double v) { return v / (1 + std::exp(-v)); }, 2e-6},
      {ops::UnaryOp::GeluTanh, gelu_tanh, 1e-5},
      {ops::UnaryOp::Relu, [](double v) { return v > 0 ? v : 0.0; }, 0},
      {ops::UnaryOp::Abs, [](double v) { return std::fabs(v); }, 0},
      {ops::UnaryOp::Neg, [](double v) { return -v; }, 0},
      {ops::UnaryOp::Sin, [](double v) { return std::sin(v); }, 2e-7, 2e-7},
      {ops::UnaryOp::Cos, [](double v) { return std::cos(v); }, 2e-7, 2e-7},
      {ops::UnaryOp::Rsqrt, [](double v) { return 1 / std::sqrt(v); }, 3e-7, 1e-30, true},
      {ops::UnaryOp::Sqrt, [](double v) { return std::sqrt(v); }, 2e-7, 1e-30, true},
      {ops::UnaryOp::Log, [](double v) { return std::log(v); }, 2e-7, 2e-7, true},
      {ops::UnaryOp::Square, [](double v) { return v * v; }, 2e-7},
      {ops::UnaryOp::Reciprocal, [](double v) { return 1 / v; }, 2e-7},
      {ops::UnaryOp::Sign, [](double v) { return static_cast<double>((v > 0) - (v < 0)); }, 0},
  };
  Tensor xpos = ops::add(ops::unary(ops::UnaryOp::Abs, x), 0.01);
  Tensor xposf = ops::to(xpos, DType::F32);
  auto vpos = xpos.to_vector<double>();
  for (auto& c : cases) {
    INFO(ops::unary_name(c.op));
    const auto& in = c.positive ? vpos : vx;
    std::vector<double> ref(in.size());
    for (size_t i = 0; i < in.size(); ++i)
      ref[i] = c.f(static_cast<double>(static_cast<float>(in[i])));
    CHECK_CLOSE(ops::unary(c.op, c.positive ? xposf : xf), from_vector(ref, {4097}), c.rtol,
                c.atol);
    // f64: the same ops to (nearly) the last bit.
    for (size_t i = 0; i < in.size(); ++i) ref[i] = c.f(in[i]);
    CHECK_CLOSE(ops::unary(c.op, c.positive ? xpos : x), from_vector(ref, {4097}), 1e-13, c.atol);
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

// The unary loops run f32 and bf16 in runs of 32 elements and the rest one
// at a time (runtime/cpu/elementwise.cpp): an element's bits must not depend
// on which of the two computes it, i.e. on where its piece of the tensor
// begins. Every op, forward and backward, on views starting 1-37 elements in.
TEST_CASE("unary ops give an element the same bits wherever its loop begins", "[kernels]") {
  using U = ops::UnaryOp;
  const int64_t n = 1000;
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    Tensor x = ops::to(ops::mul(randn({n}, 11), 3.0), dt), g = ops::to(randn({n}, 12), dt);
    Tensor pos = ops::to(ops::add(ops::unary(U::Abs, ops::to(x, DType::F32)), 0.01), dt);
    for (U op : {U::Neg, U::Exp, U::Log, U::Sqrt, U::Rsqrt, U::Abs, U::Tanh, U::Sigmoid, U::Relu, U::Gelu,
                 U::GeluTanh, U::Silu, U::Sin, U::Cos, U::Square, U::Reciprocal, U::Sign}) {
      INFO(ops::unary_name(op));
      const bool positive = op == U::Log || op == U::Sqrt || op == U::Rsqrt || op == U::Reciprocal;
      const Tensor& in = positive ? pos : x;
      Tensor y = ops::unary(op, in), gx = ops::unary_backward(op, g, in, y);
      for (int64_t at : {1, 3, 7, 31, 33, 37}) {
        INFO("from element " << at);
        Tensor part = ops::narrow(in, 0, at, n - at);
        CHECK(testing::equal(ops::unary(op, part), ops::narrow(y, 0, at, n - at)));
        CHECK(testing::equal(ops::unary_backward(op, ops::narrow(g, 0, at, n - at), part, ops::narrow(y, 0, at, n - at)),
                             ops::narrow(gx, 0, at, n - at)));
      }
    }
  }
}

TEST_CASE("pow, maximum, minimum agree with libm, with broadcasting", "[kernels]") {
  for (int64_t n : {1, 3, 17, 257}) {
    INFO("n=" << n);
    Tensor base = uniform({5, n}, 0.1, 3.0, n, DType::F64);  // pow: positive bases
    Tensor ex = ops::mul(randn({n}, n + 1, DType::F64), 2.0);
    Tensor other = randn({5, 1}, n + 2, DType::F64);
    auto vb = base.to_vector<double>(), ve = ex.to_vector<double>(), vo = other.to_vector<double>();
    std::vector<double> pw(vb.size()), mx(vb.size()), mn(vb.size());
    for (int64_t i = 0; i < 5; ++i)
      for (int64_t j = 0; j < n; ++j) {
        size_t e = static_cast<size_t>(i * n + j);
        pw[e] = std::pow(vb[e], ve[static_cast<size_t>(j)]);
        mx[e] = std::max(vb[e], vo[static_cast<size_t>(i)]);
        mn[e] = std::min(vb[e], vo[static_cast<size_t>(i)]);
      }
    for (DType dt : {DType::F64, DType::F32}) {
      INFO(dtype_name(dt));
      double rtol = dt == DType::F64 ? 1e-14 : 1e-6;
      Tensor b = ops::to(base, dt), e = ops::to(ex, dt), o = ops::to(other, dt);
      if (dt == DType::F32) {  // the reference from the f32-rounded inputs
        auto rb = b.to_vector<double>(), re = e.to_vector<double>(), ro = o.to_vector<double>();
        for (int64_t i = 0; i < 5; ++i)
          for (int64_t j = 0; j < n; ++j) {
            size_t k = static_cast<size_t>(i * n + j);
            pw[k] = std::pow(rb[k], re[static_cast<size_t>(j)]);
            mx[k] = std::max(rb[k], ro[static_cast<size_t>(i)]);
            mn[k] = std::min(rb[k], ro[static_cast<size_t>(i)]);
          }
      }
      CHECK_CLOSE(ops::binary(BinaryOp::Pow, b, e), from_vector(pw, {5, n}), rtol, 1e-300);
      CHECK_CLOSE(ops::binary(BinaryOp::Maximum, b, o), from_vector(mx, {5, n}), 0, 1e-300);
      CHECK_CLOSE(ops::binary(BinaryOp::Minimum, o, b), from_vector(mn, {5, n}), 0, 1e-300);
    }
  }
  // pow by a scalar; maximum and minimum propagate NaN from either side.
  Tensor x = uniform({17}, 0.5, 2.0, 3, DType::F64);
  auto vx = x.to_vector<double>();
  std::vector<double> p25(17);
  for (size_t i = 0; i < 17; ++i) p25[i] = std::pow(vx[i], 2.5);
  CHECK_CLOSE(ops::binary(BinaryOp::Pow, x, 2.5), from_vector(p25, {17}), 1e-14, 1e-300);
  Tensor a = from_vector<float>({NAN, 1.f, 2.f}, {3}), b = from_vector<float>({0.f, NAN, 1.f}, {3});
  for (BinaryOp op : {BinaryOp::Maximum, BinaryOp::Minimum}) {
    INFO(ops::binary_name(op));
    auto v = ops::binary(op, a, b).to_vector<double>();
    CHECK(std::isnan(v[0]));
    CHECK(std::isnan(v[1]));
    CHECK(v[2] == (op == BinaryOp::Maximum ? 2.0 : 1.0));
  }
}

TEST_CASE("comparisons: values, bool output, broadcasting, NaN", "[kernels][compare]") {
  struct Cmp {
    BinaryOp op;
    bool (*ref)(double, double);
  };
  std::vector<Cmp> cmps = {
      {BinaryOp::Lt, [](double a, double b) { return a < b; }},
      {BinaryOp::Le, [](double a, double b) { return a <= b; }},
      {BinaryOp::Gt, [](double a, double b) { return a > b; }},
      {BinaryOp::Ge, [](double a, double b) { return a >= b; }},
      {BinaryOp::Eq, [](double a, double b) { return a == b; }},
      {BinaryOp::Ne, [](double a, double b) { return a != b; }},
  };
  for (int64_t n : {1, 3, 17, 257}) {
    // Small integers, so ties (where eq, le and ge matter) are common: [3, 1, n] vs [5, 1].
    Tensor ai = randint({3, 1, n}, -2, 3, static_cast<uint64_t>(n)),
           bi = randint({5, 1}, -2, 3, static_cast<uint64_t>(n + 1));
    auto va = ai.to_vector<double>(), vb = bi.to_vector<double>();
    for (DType dt : {DType::I64, DType::F32, DType::F64, DType::BF16}) {
      Tensor a = ops::to(ai, dt), b = ops::to(bi, dt);
      for (auto& c : cmps) {
        INFO(ops::binary_name(c.op) << " " << dtype_name(dt) << " n=" << n);
        std::vector<double> ref(static_cast<size_t>(3 * 5 * n)), ref_t(ref.size());
        for (int64_t i = 0; i < 3; ++i)
          for (int64_t j = 0; j < 5; ++j)
            for (int64_t k = 0; k < n; ++k) {
              size_t e = static_cast<size_t>((i * 5 + j) * n + k);
              double x = va[static_cast<size_t>(i * n + k)], y = vb[static_cast<size_t>(j)];
              ref[e] = c.ref(x, y);
              ref_t[e] = c.ref(y, x);
            }
        Tensor r = ops::binary(c.op, a, b);
        CHECK(r.dtype() == DType::Bool);
        CHECK(r.shape() == Shape{3, 5, n});
        CHECK(r.to_vector<double>() == ref);
        CHECK(ops::binary(c.op, b, a).to_vector<double>() == ref_t);  // the broadcast operand first
      }
    }
  }
  // Against a scalar, on a transposed view; NaN compares false except for ne.
  Tensor x = ops::transpose(from_vector<float>({-1.f, 0.5f, NAN, 2.f, 0.f, 1.f}, {2, 3}), 0, 1);
  auto vx = x.to_vector<double>();
  REQUIRE(std::isnan(vx[4]));
  for (auto& c : cmps) {
    INFO(ops::binary_name(c.op));
    Tensor r = ops::binary(c.op, x, 0.5);
    CHECK(r.dtype() == DType::Bool);
    CHECK(r.shape() == Shape{3, 2});
    auto v = r.to_vector<double>();
    for (size_t i = 0; i < vx.size(); ++i) CHECK(v[i] == static_cast<double>(c.ref(vx[i], 0.5)));
    CHECK(v[4] == (c.op == BinaryOp::Ne ? 1.0 : 0.0));
    CHECK(v[2] == (c.op == BinaryOp::Le || c.op == BinaryOp::Ge || c.op == BinaryOp::Eq
                       ? 1.0
                       : 0.0));  // 0.5 vs 0.5
  }
  CHECK_THROWS_WITH(ops::binary(BinaryOp::Lt, randn({3, 2}, 1), randn({3}, 1)),
                    Catch::Contains("cannot be broadcast"));
}

namespace {
// The rotary tables as nn/transformer.cpp builds them: angle(p, i) = p * theta^(-2i / D), in
// f64, rounded to `dtype`, [rows, D/2].
std::pair<Tensor, Tensor> rope_tables(int64_t rows, int64_t d, double theta, DType dtype) {
  int64_t half = d / 2;
  std::vector<double> c(static_cast<size_t>(rows * half)), s(c.size());
  for (int64_t p = 0; p < rows; ++p)
    for (int64_t i = 0; i < half; ++i) {
      double angle = static_cast<double>(p) *
                     std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      c[static_cast<size_t>(p * half + i)] = std::cos(angle);
      s[static_cast<size_t>(p * half + i)] = std::sin(angle);
    }
  return {ops::to(from_vector(c, {rows, half}), dtype),
          ops::to(from_vector(s, {rows, half}), dtype)};
}

// Hugging Face Llama's rotation written out in f64: inv_freq = 1 / theta^(2i/D),
// cos/sin of cat(freqs, freqs), out = x * cos + rotate_half(x) * sin with
// rotate_half(x) = cat(-x[D/2:], x[:D/2]). `sign` -1 rotates back.
std::vector<double> rope_reference(const std::vector<double>& x, int64_t t, int64_t d, double theta,
                                   double sign) {
  int64_t half = d / 2, planes = static_cast<int64_t>(x.size()) / (t * d);
  std::vector<double> out(x.size());
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t pos = 0; pos < t; ++pos) {
      const double* r = &x[static_cast<size_t>((pl * t + pos) * d)];
      double* o = &out[static_cast<size_t>((pl * t + pos) * d)];
      for (int64_t j = 0; j < d; ++j) {
        double inv_freq =
            1.0 / std::pow(theta, static_cast<double>(2 * (j % half)) / static_cast<double>(d));
        double angle = sign * static_cast<double>(pos) * inv_freq;
        double rotated = j < half ? -r[j + half] : r[j - half];
        o[j] = r[j] * std::cos(angle) + rotated * std::sin(angle);
      }
    }
  return out;
}
}  // namespace

TEST_CASE("rope matches Hugging Face Llama's rotate-half rotation", "[kernels][rope]") {
  for (int64_t t : {1, 3, 17, 257}) {
    for (int64_t d : {2, 6, 34}) {
      for (double theta : {10000.0, 500000.0, 7.5}) {
        INFO("T=" << t << " D=" << d << " theta=" << theta);
        Tensor x64 = randn({2, 3, t, d}, static_cast<uint64_t>(t * 100 + d), DType::F64);
        for (DType dt : {DType::F64, DType::F32}) {
          INFO(dtype_name(dt));
          double tol = dt == DType::F64 ? 1e-12 : 2e-6;
          Tensor x = ops::to(x64, dt);
          auto vx = x.to_vector<double>();
          // A table longer than T (the model caches one for its longest sequence).
          auto [cs, sn] = rope_tables(t + 5, d, theta, dt);
          Tensor y = ops::rope(x, cs, sn);
          CHECK(y.dtype() == dt);
          CHECK_CLOSE(y, from_vector(rope_reference(vx, t, d, theta, 1.0), x.shape()), tol, tol);
          Tensor back = ops::rope(x, cs, sn, /*inverse=*/true);
          CHECK_CLOSE(back, from_vector(rope_reference(vx, t, d, theta, -1.0), x.shape()), tol,
                      tol);
          CHECK_CLOSE(ops::rope(y, cs, sn, true), x, tol, tol);  // a rotation: inverse undoes it
          // A non-contiguous input ([B, T, H, D] transposed, as the model's split_heads gives).
          Tensor xt = ops::transpose(ops::contiguous(ops::transpose(x, 1, 2)), 1, 2);
          CHECK(xt.is_contiguous() == (t == 1));  // size-1 dims have no layout
          CHECK_CLOSE(ops::rope(xt, cs, sn), y, 0, 1e-300);
        }
      }
    }
  }
  // bf16 computes in f32 and rounds once.
  Tensor x = randn({1, 2, 17, 8}, 3);
  auto [cs, sn] = rope_tables(17, 8, 10000.0, DType::F32);
  Tensor xb = ops::to(x, DType::BF16);
  Tensor yb = ops::rope(xb, cs, sn);
  CHECK(yb.dtype() == DType::BF16);
  CHECK_CLOSE(ops::to(yb, DType::F32),
              from_vector(rope_reference(xb.to_vector<double>(), 17, 8, 10000.0, 1.0), x.shape()),
              8e-3, 1e-6);
  CHECK_THROWS_WITH(ops::rope(randn({1, 1, 4, 5}, 1), cs, sn), Catch::Contains("even last dim"));
  CHECK_THROWS_WITH(ops::rope(randn({1, 1, 18, 8}, 1), cs, sn),
                    Catch::Contains("must be [>= 18, 4]"));
}

TEST_CASE("bf16 and f16 arithmetic equals f32 arithmetic rounded once", "[dtype][kernels]") {
  // Low-precision tensors compute in f32 and round the result to their dtype
  // once: compare with the f32 op on the same (already rounded) inputs.
  for (DType dt : {DType::BF16, DType::F16}) {
    for (int64_t n : {1, 3, 17, 257}) {
      INFO(dtype_name(dt) << " n=" << n);
      Tensor a = ops::to(randn({n, 19}, 1), dt), b = ops::to(randn({n, 19}, 2), dt);
      Tensor w = ops::to(randn({19, 5}, 3), dt);
      Tensor af = ops::to(a, DType::F32), bf = ops::to(b, DType::F32), wf = ops::to(w, DType::F32);
      auto same = [&](const Tensor& low, const Tensor& ref32) {
        CHECK(low.dtype() == dt);
        CHECK(testing::equal(ops::to(low, DType::F32), ops::to(ops::to(ref32, dt), DType::F32)));
      };
      same(ops::binary(BinaryOp::Add, a, b), ops::binary(BinaryOp::Add, af, bf));
      same(ops::binary(BinaryOp::Mul, a, b), ops::binary(BinaryOp::Mul, af, bf));
      same(ops::binary(BinaryOp::Div, a, b), ops::binary(BinaryOp::Div, af, bf));
      same(ops::unary(ops::UnaryOp::Exp, a), ops::unary(ops::UnaryOp::Exp, af));
      same(ops::softmax(a, 1), ops::softmax(af, 1));
      // Reductions and matmul accumulate in f32: equal to the f32 result within
      // one rounding of the output (the f32 BLAS may sum in another order).
      Tensor mm = ops::matmul(a, w), mm32 = ops::matmul(af, wf);
      CHECK(mm.dtype() == dt);
      CHECK(testing::allclose(ops::to(mm, DType::F32), mm32, dt == DType::BF16 ? 8e-3 : 1e-3, 1e-3));
      Tensor s = ops::sum(a, {1}), s32 = ops::sum(af, {1});
      CHECK(s.dtype() == dt);
      CHECK(testing::allclose(ops::to(s, DType::F32), s32, dt == DType::BF16 ? 8e-3 : 1e-3, 1e-3));
    }
  }
}

TEST_CASE("the CPU's elementwise kernels take bf16 and f16 natively: f32 math rounded once, no f32 copies",
          "[dtype][kernels]") {
  using U = ops::UnaryOp;
  using B = ops::BinaryOp;
  for (DType dt : {DType::BF16, DType::F16}) {
    INFO(dtype_name(dt));
    REQUIRE(ops::compute_dtype(Device::cpu(), KernelFamily::Elementwise, dt) == dt);
    // Awkward sizes, a transposed operand and broadcasting; inputs already in
    // dt, so the f32 reference sees exactly the same values.
    Tensor x = ops::to(ops::mul(randn({37, 29}, 1), 2.0), dt), g = ops::to(randn({37, 29}, 2), dt);
    Tensor pos = ops::to(ops::add(ops::unary(U::Abs, ops::to(x, DType::F32)), 0.25), dt);
    Tensor row = ops::to(randn({1, 29}, 3), dt), xt = ops::transpose(ops::to(randn({29, 37}, 4), dt), 0, 1);
    Tensor row_pos = ops::to(ops::add(ops::unary(U::Abs, ops::to(row, DType::F32)), 0.25), dt);
    auto f = [](const Tensor& t) { return ops::to(t, DType::F32); };
    auto same = [&](const std::string& what, const Tensor& low, const Tensor& ref32) {
      INFO(what);
      CHECK(low.dtype() == (ref32.dtype() == DType::Bool ? DType::Bool : dt));
      Tensor want = ref32.dtype() == DType::Bool ? ref32 : ops::to(ref32, dt);
      CHECK(testing::equal(ops::to(low, DType::F64), ops::to(want, DType::F64)));
    };
    for (U op : {U::Neg, U::Exp, U::Log, U::Sqrt, U::Rsqrt, U::Abs, U::Tanh, U::Sigmoid, U::Relu, U::Gelu,
                 U::GeluTanh, U::Silu, U::Sin, U::Cos, U::Square, U::Reciprocal, U::Sign}) {
      bool positive = op == U::Log || op == U::Sqrt || op == U::Rsqrt || op == U::Reciprocal;
      const Tensor& in = positive ? pos : x;
      Tensor y = ops::unary(op, in);
      same(ops::unary_name(op), y, ops::unary(op, f(in)));
      same(std::string(ops::unary_name(op)) + " transposed", ops::unary(op, ops::transpose(in, 0, 1)),
           ops::unary(op, ops::transpose(f(in), 0, 1)));
      same(std::string(ops::unary_name(op)) + ".backward", ops::unary_backward(op, g, in, y),
           ops::unary_backward(op, f(g), f(in), f(y)));
    }
    for (B op : {B::Add, B::Sub, B::Mul, B::Div, B::Pow, B::Maximum, B::Minimum, B::Lt, B::Ge, B::Eq}) {
      const Tensor& lhs = op == B::Pow ? pos : x;
      std::string name = ops::binary_name(op);
      same(name, ops::binary(op, lhs, g), ops::binary(op, f(lhs), f(g)));
      same(name + " broadcast", ops::binary(op, lhs, row), ops::binary(op, f(lhs), f(row)));
      const Tensor& first = op == B::Pow ? row_pos : row;  // a negative base to a fractional power is NaN
      same(name + " broadcast first", ops::binary(op, first, lhs), ops::binary(op, f(first), f(lhs)));
      same(name + " transposed", ops::binary(op, lhs, xt), ops::binary(op, f(lhs), f(xt)));
    }
    // In-place updates: the scalar stays f32 (0.99 is not rounded to dt first).
    auto inplace = [&](const std::string& what, auto&& update) {
      Tensor low = ops::clone(x), ref = f(x);
      update(low);
      update(ref);
      same(what, low, ref);
    };
    inplace("add_", [&](const Tensor& t) { ops::add_(t, t.dtype() == dt ? g : f(g), 0.37); });
    inplace("add_ scalar", [](const Tensor& t) { ops::add_(t, 0.99); });
    inplace("mul_ scalar", [](const Tensor& t) { ops::mul_(t, 0.99); });
    inplace("mul_ broadcast", [&](const Tensor& t) { ops::mul_(t, t.dtype() == dt ? row : f(row)); });
    inplace("div_", [&](const Tensor& t) { ops::div_(t, t.dtype() == dt ? pos : f(pos)); });
    inplace("addcmul_", [&](const Tensor& t) {
      ops::addcmul_(t, t.dtype() == dt ? g : f(g), t.dtype() == dt ? pos : f(pos), -0.3);
    });
    inplace("addcdiv_", [&](const Tensor& t) {
      ops::addcdiv_(t, t.dtype() == dt ? g : f(g), t.dtype() == dt ? pos : f(pos), 0.7);
    });
    inplace("lerp_", [&](const Tensor& t) { ops::lerp_(t, t.dtype() == dt ? g : f(g), 0.1); });
    inplace("clamp_", [](const Tensor& t) { ops::clamp_(t, -0.51, 0.77); });
    inplace("sqrt_ of abs", [](const Tensor& t) { ops::sqrt_(ops::copy_(t, ops::unary(U::Abs, t))); });
  }
  // No f32 copy of a whole tensor: GELU forward and backward on 1M bf16
  // elements allocate their 2 MB outputs and nothing more.
  Tensor big = ops::to(randn({1024, 1024}, 5), DType::BF16);
  Tensor gb = ops::to(randn({1024, 1024}, 6), DType::BF16);
  reset_peak_memory_stats();
  int64_t base = memory_stats().allocated_bytes;
  Tensor y = ops::unary(U::Gelu, big);
  Tensor gx = ops::unary_backward(U::Gelu, gb, big, y);
  CHECK(memory_stats().peak_allocated_bytes - base == 2 * 1024 * 1024 * 2);
}

// Softmax, the norms and cross entropy on bf16/f16: the f32 kernel's result
// rounded once, bit for bit, with statistics in f32.
TEST_CASE("the CPU's row kernels take bf16 and f16 natively", "[dtype][kernels]") {
  auto f = [](const Tensor& t) { return ops::to(t, DType::F32); };
  for (DType dt : {DType::BF16, DType::F16}) {
    INFO(dtype_name(dt));
    for (KernelFamily family : {KernelFamily::Softmax, KernelFamily::Norm, KernelFamily::CrossEntropy})
      REQUIRE(ops::compute_dtype(Device::cpu(), family, dt) == dt);
    auto same = [&](const std::string& what, const Tensor& low, const Tensor& ref32) {
      INFO(what);
      CHECK(low.dtype() == dt);
      CHECK(testing::equal(ops::to(low, DType::F64), ops::to(ops::to(ref32, dt), DType::F64)));
    };
    auto same_f32 = [&](const std::string& what, const Tensor& stats, const Tensor& ref32) {
      INFO(what);
      CHECK(stats.dtype() == DType::F32);
      CHECK(testing::equal(stats, ref32));
    };
    // Awkward widths (one vector and a tail, a single element), rows with -inf.
    for (int64_t n : {1, 19, 67}) {
      INFO("n=" << n);
      Tensor x = ops::to(ops::mul(randn({2, 13, n}, 1), 3.0), dt), g = ops::to(randn({2, 13, n}, 2), dt);
      Tensor w = ops::to(randn({n}, 3), dt), b = ops::to(randn({n}, 4), dt);
      same("softmax", ops::softmax(x, -1), ops::softmax(f(x), -1));
      same("softmax over dim 1", ops::softmax(x, 1), ops::softmax(f(x), 1));
      same("log_softmax", ops::log_softmax(x, -1), ops::log_softmax(f(x), -1));
      Tensor y = ops::softmax(x, -1), ly = ops::log_softmax(x, -1);
      same("softmax_backward", ops::softmax_backward(g, y, -1), ops::softmax_backward(f(g), f(y), -1));
      same("log_softmax_backward", ops::log_softmax_backward(g, ly, -1),
           ops::log_softmax_backward(f(g), f(ly), -1));

      ops::NormResult ln = ops::layer_norm(x, w, b, 1e-5), ln32 = ops::layer_norm(f(x), f(w), f(b), 1e-5);
      same("layer_norm", ln.y, ln32.y);
      same_f32("layer_norm mean", ln.mean, ln32.mean);
      same_f32("layer_norm rstd", ln.rstd, ln32.rstd);
      ops::NormGrads lg = ops::layer_norm_backward(g, x, w, ln.mean, ln.rstd, true);
      ops::NormGrads lg32 = ops::layer_norm_backward(f(g), f(x), f(w), ln32.mean, ln32.rstd, true);
      same("layer_norm dx", lg.dx, lg32.dx);
      same("layer_norm dweight", lg.dweight, lg32.dweight);
      same("layer_norm dbias", lg.dbias, lg32.dbias);
      ops::NormResult rn = ops::rms_norm(x, w, 1e-6), rn32 = ops::rms_norm(f(x), f(w), 1e-6);
      same("rms_norm", rn.y, rn32.y);
      same_f32("rms_norm rstd", rn.rstd, rn32.rstd);
      ops::NormGrads rg = ops::rms_norm_backward(g, x, w, rn.rstd, true);
      ops::NormGrads rg32 = ops::rms_norm_backward(f(g), f(x), f(w), rn32.rstd, true);
      same("rms_norm dx", rg.dx, rg32.dx);
      same("rms_norm dweight", rg.dweight, rg32.dweight);
      ops::NormResult nw = ops::layer_norm(x, Tensor(), Tensor(), 1e-5);
      same("layer_norm without affine", nw.y, ops::layer_norm(f(x), Tensor(), Tensor(), 1e-5).y);

      Tensor logits = ops::reshape(x, {26, n});
      Tensor target = randint({26}, 0, n, 5);
      ops::copy_(ops::narrow(target, 0, 3, 1), full({1}, -100.0, DType::I64));  // one ignored row
      ops::CrossEntropyResult ce = ops::cross_entropy(logits, target), ce32 = ops::cross_entropy(f(logits), target);
      same("cross_entropy", ce.loss, ce32.loss);
      same_f32("cross_entropy lse", ce.lse, ce32.lse);
      Tensor gl = ops::to(full({}, 0.7), dt);
      same("cross_entropy_backward", ops::cross_entropy_backward(gl, logits, target, ce.lse, -100, ce.count),
           ops::cross_entropy_backward(f(gl), f(logits), target, ce32.lse, -100, ce32.count));
    }
    // Masked entries, as a causal mask leaves them.
    const double inf = std::numeric_limits<double>::infinity();
    Tensor masked = ops::to(from_vector(std::vector<double>{-inf, 1.5, 2.25, -inf, 0.0, 3.0, -inf, -inf, -inf, -2.0},
                                        {2, 5}),
                            dt);
    same("softmax with -inf entries", ops::softmax(masked, -1), ops::softmax(f(masked), -1));
    same("log_softmax with -inf entries", ops::log_softmax(masked, -1), ops::log_softmax(f(masked), -1));
  }
  // No f32 copy: layer norm of a [512, 1024] bf16 tensor allocates its 1 MiB
  // output and two f32 statistics rows, nothing more.
  Tensor big = ops::to(randn({512, 1024}, 7), DType::BF16);
  reset_peak_memory_stats();
  int64_t base = memory_stats().allocated_bytes;
  ops::NormResult r = ops::layer_norm(big, Tensor(), Tensor(), 1e-5);
  CHECK(memory_stats().peak_allocated_bytes - base == 512 * 1024 * 2 + 2 * 512 * 4);
}

TEST_CASE("the CPU's attention and RoPE take bf16 and f16 natively", "[dtype][kernels][attention]") {
  auto f = [](const Tensor& t) { return ops::to(t, DType::F32); };
  for (DType dt : {DType::BF16, DType::F16}) {
    REQUIRE(ops::compute_dtype(Device::cpu(), KernelFamily::Attention, dt) == dt);
    REQUIRE(ops::compute_dtype(Device::cpu(), KernelFamily::Rope, dt) == dt);
    auto same = [&](const char* what, const Tensor& low, const Tensor& ref32) {
      INFO(what);
      CHECK(low.dtype() == dt);
      CHECK(testing::equal(ops::to(low, DType::F64), ops::to(ops::to(ref32, dt), DType::F64)));
    };
    // RoPE with f32 angles (not rounded to bf16), forward and inverse, odd planes and positions.
    Tensor x = ops::to(randn({3, 5, 11, 14}, 6), dt);
    auto [cs, sn] = rope_tables(13, 14, 500.0, DType::F32);
    for (bool inverse : {false, true}) same("rope", ops::rope(x, cs, sn, inverse), ops::rope(f(x), cs, sn, inverse));
    // Bit for bit the f32 kernel on widened copies: awkward lengths (a single
    // query, one block and a tail), grouped heads, keys longer than queries.
    for (auto [t, s, hkv] : {std::tuple{1, 1, 3}, {67, 67, 1}, {130, 130, 3}, {19, 83, 1}}) {
      for (bool causal : {true, false}) {
        INFO(dtype_name(dt) << " T=" << t << " S=" << s << " kv heads=" << hkv << " causal=" << causal);
        Tensor q = ops::to(randn({2, 3, t, 24}, 1), dt), k = ops::to(randn({2, hkv, s, 24}, 2), dt);
        Tensor v = ops::to(randn({2, hkv, s, 24}, 3), dt), dout = ops::to(randn({2, 3, t, 24}, 4), dt);
        ops::AttentionResult r = ops::attention(q, k, v, causal, 0.2), r32 = ops::attention(f(q), f(k), f(v), causal, 0.2);
        same("out", r.out, r32.out);
        CHECK(r.lse.dtype() == DType::F32);
        CHECK(testing::equal(r.lse, r32.lse));
        ops::AttentionGrads g = ops::attention_backward(dout, q, k, v, r.out, r.lse, causal, 0.2);
        ops::AttentionGrads g32 = ops::attention_backward(f(dout), f(q), f(k), f(v), f(r.out), r.lse, causal, 0.2);
        same("dq", g.dq, g32.dq);
        same("dk", g.dk, g32.dk);
        same("dv", g.dv, g32.dv);
      }
    }
  }
  // No f32 copy of a whole tensor: a bf16 forward over [2, 8, 1024, 64]
  // allocates its output, the f32 logsumexp and per-thread block scratch.
  Tensor q = ops::to(randn({2, 8, 1024, 64}, 5), DType::BF16);
  reset_peak_memory_stats();
  int64_t base = memory_stats().allocated_bytes;
  ops::AttentionResult r = ops::attention(q, q, q, true, 0.125);
  int64_t scratch = num_threads() * cpu::attention_scratch_per_thread(64, true) * 4;
  CHECK(memory_stats().peak_allocated_bytes - base <= q.numel() * 2 + 2 * 8 * 1024 * 4 + scratch + 4096);
}

TEST_CASE("embedding takes i32 or i64 indices alike; other index dtypes are refused", "[kernels][embedding]") {
  Tensor weight = randn({17, 3}, 4);
  Tensor idx64 = randint({5, 7}, 0, 17, 5);
  Tensor idx32 = ops::to(idx64, DType::I32);
  CHECK(testing::equal(ops::embedding(weight, idx32), ops::embedding(weight, idx64)));
  CHECK_THROWS_WITH(ops::embedding(weight, ops::to(idx64, DType::F32)), Catch::Contains("f32"));
  Tensor bad = ops::to(full({2}, 17.0, DType::F64), DType::I32);
  CHECK_THROWS_WITH(ops::embedding(weight, bad), Catch::Contains("17"));
}
