// Single kernels of a training step, one at a time (median of repeated
// calls, allocation included): dtype conversions, GELU in f32, bf16 and f16
// (GELU-tanh's backward in f32 in cache and out of it; on AVX2 machines its
// earlier tanh form against the sigmoid form, alternating), layer
// norm forward and backward, the gradient norm's sum of squares, bias
// gradients' sums over rows in cache and out of it,
// cross-entropy over a GPT-2 vocabulary, attention forward and backward;
// then GPT-2's c_fc and GELU, forward and backward, with the bias fused into
// GELU's passes (bias_gelu) against the bias in the product and GELU apart,
// alternating, in f32 and bf16 (the ratio: above 1, the fused is faster);
// the residual add and layer norm apart and fused (add_layer_norm), the same
// way; last AdamW's step and clipping's scale over the default model's 52
// parameters against the same elements in one flat buffer, alternating (the
// ratio: above 1, the flat buffer is faster).
//   OMP_NUM_THREADS=1 build/benchmarks/bench_kernels
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/math.h"
#include "runtime/ops.h"
#include "runtime/parallel.h"
#include "runtime/random.h"

using namespace tessera;

namespace {

template <class F>
double median_ms(F&& f, int reps) {
  f();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void row(const char* name, double ms) { std::printf("%-40s %9.3f ms\n", name, ms); }

// Two ways of the same work, alternating 15 rounds (each the median of
// `reps` calls): the medians of their rounds.
template <class F, class G>
std::pair<double, double> alternate_ms(F&& first, G&& second, int reps) {
  std::vector<double> a, b;
  for (int round = 0; round < 15; ++round) {
    a.push_back(median_ms(first, reps));
    b.push_back(median_ms(second, reps));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return {a[a.size() / 2], b[b.size() / 2]};
}

#if defined(__x86_64__)
// GELU's tanh form as it was before 2026-12-07, 0.5 x (1 + tanh(u)) with the
// f32 tanh, against the form the kernels use now, x / (1 + e^{-2u})
// (runtime/math.h): each a plain loop compiled for AVX2 with FMA, as the avx2
// kernel copy is, so the two differ by the formula alone.
[[gnu::target("avx2,fma")]] void gelu_tanh_before(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = 0.79788456080286535588f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
    y[i] = 0.5f * x[i] * (1.0f + math::fast_tanh(u));
  }
}
[[gnu::target("avx2,fma")]] void gelu_tanh_now(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = math::apply_unary(ops::UnaryOp::GeluTanh, x[i]);
}
[[gnu::target("avx2,fma")]] void gelu_tanh_backward_before(float* d, const float* g, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float k = 0.79788456080286535588f, x2 = x[i] * x[i];
    const float t = math::fast_tanh(k * (x[i] + 0.044715f * x2 * x[i]));
    const float dinner = k * (1.0f + 3.0f * 0.044715f * x2);
    d[i] = g[i] * (0.5f * (1.0f + t) + 0.5f * x[i] * (1.0f - t * t) * dinner);
  }
}
[[gnu::target("avx2,fma")]] void gelu_tanh_backward_now(float* d, const float* g, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = math::apply_unary_backward(ops::UnaryOp::GeluTanh, g[i], x[i], x[i]);
}
#endif

}  // namespace

int main() {
  std::printf("threads %d\n", num_threads());
  Tensor x = randn({1024, 1024}, 1), g = randn({1024, 1024}, 2);
  Tensor xb = ops::to(x, DType::BF16), xh = ops::to(x, DType::F16), gb = ops::to(g, DType::BF16);
  row("f32 -> bf16, 1M", median_ms([&] { ops::to(x, DType::BF16); }, 50));
  row("bf16 -> f32, 1M", median_ms([&] { ops::to(xb, DType::F32); }, 50));
  row("f32 -> f16, 1M", median_ms([&] { ops::to(x, DType::F16); }, 20));
  row("f16 -> f32, 1M", median_ms([&] { ops::to(xh, DType::F32); }, 20));
  row("f32 copy, 1M", median_ms([&] { ops::clone(x); }, 50));
  using U = ops::UnaryOp;
  Tensor y = ops::unary(U::Gelu, x), yb = ops::unary(U::Gelu, xb);
  row("gelu f32, 1M", median_ms([&] { ops::unary(U::Gelu, x); }, 20));
  row("gelu backward f32, 1M", median_ms([&] { ops::unary_backward(U::Gelu, g, x, y); }, 20));
  row("gelu bf16, 1M", median_ms([&] { ops::unary(U::Gelu, xb); }, 20));
  row("gelu backward bf16, 1M", median_ms([&] { ops::unary_backward(U::Gelu, gb, xb, yb); }, 20));
  // GPT-2's GELU (tanh) backward as a step meets it: its operands out of
  // cache, 16 pairs of [1024, 1024] (128 MiB) in turn; and the same on one
  // pair, in cache. The gap is memory, pages included (TESSERA_HUGE_PAGES=0
  // puts the operands in 4 KiB pages: runtime/allocator.h).
  std::vector<Tensor> xs, gs;
  for (int i = 0; i < 16; ++i) xs.push_back(randn({1024, 1024}, 100 + i)), gs.push_back(randn({1024, 1024}, 200 + i));
  int turn = 0;
  row("gelu_tanh backward f32, 1M, in cache", median_ms([&] { ops::unary_backward(U::GeluTanh, g, x, Tensor()); }, 32));
  row("gelu_tanh backward f32, 1M, out of cache", median_ms([&] {
        ops::unary_backward(U::GeluTanh, gs[turn % 16], xs[turn % 16], Tensor());
        ++turn;
      }, 32));
  row("gelu_tanh f32, 1M", median_ms([&] { ops::unary(U::GeluTanh, x); }, 20));
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    Tensor out = empty_like(x);
    float* o = out.data<float>();
    const float *xp = x.data<float>(), *gp = g.data<float>();
    const int64_t n = x.numel();
    auto [before, now] = alternate_ms([&] { gelu_tanh_before(o, xp, n); }, [&] { gelu_tanh_now(o, xp, n); }, 10);
    std::printf("gelu_tanh f32 1M, AVX2 loops: 0.5 x (1 + tanh u) %8.3f ms, x / (1 + e^-2u) %8.3f ms -> ratio %.3f\n",
                before, now, before / now);
    std::tie(before, now) = alternate_ms([&] { gelu_tanh_backward_before(o, gp, xp, n); },
                                         [&] { gelu_tanh_backward_now(o, gp, xp, n); }, 10);
    std::printf("gelu_tanh backward f32 1M, AVX2 loops: tanh form %8.3f ms, sigmoid form %8.3f ms -> ratio %.3f\n",
                before, now, before / now);
  }
#endif
  Tensor gh = ops::to(g, DType::F16), yh = ops::unary(U::Gelu, xh);
  row("gelu f16, 1M", median_ms([&] { ops::unary(U::Gelu, xh); }, 20));
  row("gelu backward f16, 1M", median_ms([&] { ops::unary_backward(U::Gelu, gh, xh, yh); }, 20));
  Tensor h = randn({1024, 256}, 3), dh = randn({1024, 256}, 4), w = randn({256}, 5), b = randn({256}, 6);
  ops::NormResult ln = ops::layer_norm(h, w, b, 1e-5);
  row("layer_norm [1024, 256]", median_ms([&] { ops::layer_norm(h, w, b, 1e-5); }, 100));
  row("layer_norm backward [1024, 256]",
      median_ms([&] { ops::layer_norm_backward(dh, h, w, ln.mean, ln.rstd, true); }, 100));
  std::vector<Tensor> grads;
  for (int i = 0; i < 20; ++i) grads.push_back(randn({160000}, 10 + i));
  row("sum_squares, 20 x 160000", median_ms([&] { ops::sum_squares(grads, Device::cpu()); }, 20));
  // Bias gradients: sums over the rows of [1024, N], as a step meets them (16
  // operands in turn, out of cache) and on one operand (in cache).
  for (int64_t n : {256, 768, 3072}) {
    std::vector<Tensor> dys;
    for (int i = 0; i < 16; ++i) dys.push_back(randn({1024, n}, 300 + i));
    char name[64];
    std::snprintf(name, sizeof name, "sum over rows [1024, %lld], in cache", static_cast<long long>(n));
    row(name, median_ms([&] { ops::sum(dys[0], {0}); }, 32));
    std::snprintf(name, sizeof name, "sum over rows [1024, %lld], out of cache", static_cast<long long>(n));
    int next = 0;
    row(name, median_ms([&] { ops::sum(dys[next++ % 16], {0}); }, 32));
  }
  Tensor logits = randn({1024, 50257}, 7), target = randint({1024}, 0, 50257, 8);
  row("cross_entropy [1024, 50257]", median_ms([&] { ops::cross_entropy(logits, target); }, 5));
  Tensor q = randn({8, 4, 128, 64}, 9), k = randn({8, 4, 128, 64}, 10), v = randn({8, 4, 128, 64}, 11);
  Tensor dout = randn({8, 4, 128, 64}, 12);
  ops::AttentionResult at = ops::attention(q, k, v, true, 0.125);
  row("attention [8, 4, 128, 64], causal", median_ms([&] { ops::attention(q, k, v, true, 0.125); }, 20));
  row("attention backward", median_ms([&] {
        ops::attention_backward(dout, q, k, v, at.out, at.lse, true, 0.125);
      }, 20));
  // c_fc and GELU of the default bench_step model (4 x 256 tokens, width
  // 256, hidden 1024): forward, then backward with every gradient.
  for (DType dt : {DType::F32, DType::BF16}) {
    // Weights at GPT-2's init scale (products of order 1: no subnormal tails).
    Tensor xs = ops::to(randn({1024, 256}, 13), dt), wfc = ops::to(ops::mul(randn({1024, 256}, 14), 0.1), dt);
    Tensor bfc = ops::to(randn({1024}, 15), dt), gy = ops::to(randn({1024, 1024}, 16), dt);
    const U gelu = U::Gelu;
    auto unfused = [&] {
      Tensor z = ops::linear(xs, wfc, bfc);
      ops::unary(gelu, z);
      ops::linear_backward(ops::unary_backward(gelu, gy, z, Tensor()), xs, wfc, {true, true, true});
    };
    auto fused = [&] {
      Tensor h = ops::linear(xs, wfc);
      ops::bias_gelu(h, bfc, false);
      ops::linear_backward(ops::bias_gelu_backward(gy, h, bfc, false)[0], xs, wfc, {true, true, false});
    };
    const auto [ua, fb] = alternate_ms(unfused, fused, 5);
    std::printf("c_fc + gelu fwd+bwd %-4s unfused %8.3f ms, fused %8.3f ms -> ratio %.3f\n", dtype_name(dt), ua, fb,
                ua / fb);
  }
  // A pre-norm block's residual add and the norm after it, forward (their
  // backward is the same either way): add, then layer_norm (rms_norm),
  // against add_layer_norm (add_rms_norm), alternating, at the default model's rows and width, the
  // 8 x 512 model's and GPT-2's.
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t width : {256, 512, 768}) {
      Tensor xr = ops::to(randn({1024, width}, 17), dt), rr = ops::to(randn({1024, width}, 18), dt);
      Tensor wr = ops::to(randn({width}, 19), dt), br = ops::to(randn({width}, 20), dt);
      for (bool rms : {false, true}) {
        auto unfused = [&] {
          Tensor h = ops::add(xr, rr);
          rms ? ops::rms_norm(h, wr, 1e-5) : ops::layer_norm(h, wr, br, 1e-5);
        };
        auto fused = [&] { rms ? ops::add_rms_norm(xr, rr, wr, 1e-5) : ops::add_layer_norm(xr, rr, wr, br, 1e-5); };
        const auto [ua, fb] = alternate_ms(unfused, fused, 21);
        std::printf("add + %-10s [1024, %lld] %-4s unfused %7.3f ms, fused %7.3f ms -> ratio %.3f\n",
                    rms ? "rms_norm" : "layer_norm", static_cast<long long>(width), dtype_name(dt), ua, fb, ua / fb);
      }
    }
  // The default bench_step model's parameters (4 layers of width 256, 256
  // tokens, 128 positions): 52 tensors, 3.3M elements; and one flat buffer.
  std::vector<Shape> shapes = {{256, 256}, {128, 256}, {256}, {256}};
  for (int layer = 0; layer < 4; ++layer)
    for (Shape s : std::vector<Shape>{{256}, {256}, {768, 256}, {768}, {256, 256}, {256},
                                      {256}, {256}, {1024, 256}, {1024}, {256, 1024}, {256}})
      shapes.push_back(s);
  int64_t total = 0;
  for (const Shape& s : shapes) total += shape_numel(s);
  for (DType dt : {DType::F32, DType::BF16}) {
    struct Set {
      std::vector<Tensor> p, g, m, v;
    };
    auto make = [&](const std::vector<Shape>& list) {
      Set set;
      uint64_t seed = 100;
      for (const Shape& s : list) {
        set.p.push_back(ops::to(randn(s, seed++), dt));
        set.g.push_back(ops::to(randn(s, seed++), dt));
        set.m.push_back(zeros_like(set.p.back()));
        set.v.push_back(zeros_like(set.p.back()));
      }
      return set;
    };
    Set many = make(shapes), flat = make({{total}});
    Tensor coef = scalar_tensor(0.999, DType::F64);
    int64_t step = 0;
    auto scale = [&](Set& set) { ops::scale_(set.g, coef); };
    auto adamw = [&](Set& set) { ops::adamw_(set.p, set.g, set.m, set.v, {1e-3, 0.9, 0.95, 1e-8, 0.1, ++step}); };
    for (auto [name, op] : {std::pair<const char*, std::function<void(Set&)>>{"scale_", scale}, {"adamw_", adamw}}) {
      const auto [ma, fb] = alternate_ms([&] { op(many); }, [&] { op(flat); }, 5);
      std::printf("%s %-4s %zu tensors %8.3f ms, flat %8.3f ms -> ratio %.3f\n", name, dtype_name(dt), shapes.size(),
                  ma, fb, ma / fb);
    }
  }
}
