// The CPU kernels' sums (runtime/cpu/sums.h) and their thread splits: every
// result is the same, bit for bit, on 1, 2 and 3 threads (a long contiguous
// run and a long row are split across threads; the weight gradients of a norm
// are summed in row blocks), and the sums agree with f64 sums of the same
// values.
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "runtime/allocator.h"
#include "runtime/kernels.h"
#include "runtime/parallel.h"
#include "tests/helpers.h"

using namespace tessera;

namespace {

using Results = std::vector<std::pair<std::string, Tensor>>;

// Restores the thread count when a check fails and the test case ends.
struct ThreadsGuard {
  int saved = num_threads();
  ~ThreadsGuard() { set_num_threads(saved); }
};

// Sizes that cross the splits: runs longer than two 32768-element grains
// (split over threads), rows longer than two 16384-element chunks, a norm
// over 300 rows (five row blocks), all of them odd.
Results split_results() {
  Results r;
  auto add = [&](std::string name, const Tensor& t) { r.emplace_back(std::move(name), ops::clone(t)); };
  Tensor x = randn({3, 40011}, 1), g = randn({3, 40011}, 2);
  Tensor y = ops::unary(ops::UnaryOp::Gelu, x);
  add("gelu", y);
  add("gelu.backward", ops::unary_backward(ops::UnaryOp::Gelu, g, x, y));
  add("add", ops::add(x, g));
  add("add broadcast rows", ops::add(randn({2, 1}, 3), randn({2, 90001}, 4)));
  add("copy", ops::contiguous(ops::transpose(ops::transpose(x, 0, 1), 0, 1)));
  add("sum long rows", ops::sum(x, {1}));
  add("sum all", ops::sum(ops::reshape(x, {3 * 40011}), {0}));
  add("mean", ops::mean(x));
  add("sum f64", ops::sum(ops::to(x, DType::F64), {1}));
  add("sum over rows", ops::sum(randn({3001, 300}, 13), {0}));  // a bias gradient
  // Six column blocks cut into pieces as wide as the threads ask (1300
  // columns on 1 thread, 650 on 3), and a middle dim between two others.
  add("sum over rows, wide", ops::sum(randn({1100, 1300}, 14), {0}));
  add("sum over the middle dim", ops::sum(randn({3, 700, 513}, 15), {1}));
  add("sum_squares", ops::sum_squares({x, g, randn({13, 17}, 5)}, Device::cpu()));
  Tensor h = randn({300, 37}, 6), dh = randn({300, 37}, 7), w = randn({37}, 8), b = randn({37}, 9);
  ops::NormResult ln = ops::layer_norm(h, w, b, 1e-5);
  add("layer_norm", ln.y);
  ops::NormGrads lg = ops::layer_norm_backward(dh, h, w, ln.mean, ln.rstd, true);
  add("layer_norm_backward dx", lg.dx);
  add("layer_norm_backward dweight", lg.dweight);
  add("layer_norm_backward dbias", lg.dbias);
  ops::NormResult rn = ops::rms_norm(h, w, 1e-6);
  add("rms_norm_backward dweight", ops::rms_norm_backward(dh, h, w, rn.rstd, true).dweight);
  Tensor logits = randn({7, 1003}, 10), target = randint({7}, 0, 1003, 11);
  ops::CrossEntropyResult ce = ops::cross_entropy(logits, target);
  add("cross_entropy", ce.loss);
  add("softmax", ops::softmax(logits, -1));
  add("log_softmax_backward",
      ops::log_softmax_backward(randn({7, 1003}, 12), ops::log_softmax(logits, -1), -1));
  return r;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// sum over rows of column j of a [rows, n] f32 tensor, in f64.
std::vector<double> column_sums(const Tensor& t) {
  std::vector<float> v = t.to_vector<float>();
  int64_t rows = t.size(0), n = t.size(1);
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) out[static_cast<size_t>(j)] += v[static_cast<size_t>(r * n + j)];
  return out;
}

}  // namespace

TEST_CASE("CPU kernels give the same bits on 1, 2 and 3 threads", "[kernels][threads]") {
  ThreadsGuard guard;
  set_num_threads(1);
  Results one = split_results();
  for (int threads : {2, 3}) {
    set_num_threads(threads);
    Results got = split_results();
    REQUIRE(got.size() == one.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(threads << " threads: " << got[i].first);
      CHECK(same_bits(got[i].second, one[i].second));
    }
  }
}

TEST_CASE("lane-ordered sums agree with f64 sums", "[kernels][threads]") {
  ThreadsGuard guard;
  set_num_threads(2);
  for (int64_t n : {1, 7, 8, 9, 16383, 40011, 100003}) {
    INFO("n=" << n);
    Tensor x = ops::add(randn({n}, static_cast<uint64_t>(n)), 0.5);
    std::vector<float> v = x.to_vector<float>();
    double sum = 0, squares = 0;
    for (float f : v) {
      sum += f;
      squares += static_cast<double>(f) * f;
    }
    // An f32 sum accumulated in f64 is the f64 sum rounded once.
    CHECK(static_cast<float>(ops::sum(x).item()) == static_cast<float>(sum));
    CHECK(std::abs(ops::sum_squares(x) - squares) <= 1e-12 * squares);
    std::vector<double> vd(v.begin(), v.end());
    Tensor xd = from_vector(vd, {n});
    CHECK(std::abs(ops::sum(xd).item() - sum) <= 1e-13 * std::max(1.0, std::abs(sum)) * std::sqrt(double(n)));
  }
  // Column sums over many rows (a bias gradient), split into row parts.
  Tensor rows = randn({3001, 300}, 13);
  std::vector<double> want = column_sums(rows);
  std::vector<float> got = ops::sum(rows, {0}).to_vector<float>();
  for (size_t j = 0; j < want.size(); ++j) CHECK(got[j] == static_cast<float>(want[j]));
  // Layer norm's weight and bias gradients: column sums over the rows.
  Tensor h = randn({300, 37}, 6), dh = randn({300, 37}, 7), w = randn({37}, 8), b = randn({37}, 9);
  ops::NormResult ln = ops::layer_norm(h, w, b, 1e-5);
  ops::NormGrads lg = ops::layer_norm_backward(dh, h, w, ln.mean, ln.rstd, true);
  Tensor xhat = ops::mul(ops::sub(h, ops::unsqueeze(ln.mean, 1)), ops::unsqueeze(ln.rstd, 1));
  std::vector<double> db = column_sums(dh), dw = column_sums(ops::mul(dh, xhat));
  std::vector<float> got_b = lg.dbias.to_vector<float>(), got_w = lg.dweight.to_vector<float>();
  for (size_t j = 0; j < db.size(); ++j) {
    INFO("column " << j);
    CHECK(got_b[j] == static_cast<float>(db[j]));
    CHECK(std::abs(got_w[j] - dw[j]) <= 1e-5 * (1.0 + std::abs(dw[j])));
  }
}

TEST_CASE("sum_squares reads bf16 and f16 as they are", "[sums][dtype]") {
  for (DType dt : {DType::BF16, DType::F16}) {
    INFO(dtype_name(dt));
    // Awkward lengths, a scale where f16 squares would overflow in f16 (not in f64).
    std::vector<Tensor> xs = {ops::to(ops::mul(randn({1000003}, 1), 300.0), dt), ops::to(randn({7, 13}, 2), dt),
                              ops::to(randn({1}, 3), dt)};
    std::vector<Tensor> wide;
    double expect = 0;
    for (const Tensor& x : xs) {
      wide.push_back(ops::to(x, DType::F32));
      for (double v : x.to_vector<double>()) expect += v * v;
    }
    reset_peak_memory_stats();
    const int64_t base = memory_stats().allocated_bytes;
    const double got = ops::sum_squares(xs, Device::cpu()).item();
    CHECK(memory_stats().peak_allocated_bytes - base <= 64);  // the f64 result, no f32 copy
    CHECK(got == ops::sum_squares(wide, Device::cpu()).item());  // the same squares in the same order
    CHECK(std::abs(got - expect) <= 1e-12 * expect);
  }
}

TEST_CASE("sums of bf16 and f16 read them where they lie, with the bits of a widened copy's", "[sums][dtype]") {
  struct Case {
    Shape shape;
    std::vector<int64_t> dims;
    bool keepdim;
  };
  // A bias gradient (rows summed in parts), a short and a long row, the
  // middle dim, non-adjacent dims (the permuted copy), everything.
  const std::vector<Case> cases = {{{1027, 300}, {0}, false}, {{5, 40011}, {1}, false}, {{3, 257, 7}, {1}, true},
                                   {{3, 257, 7}, {0, 2}, false}, {{17, 33}, {}, false}, {{1, 1}, {0}, true}};
  for (DType dt : {DType::BF16, DType::F16}) {
    for (Device device : {Device::cpu(), Device::async_cpu()}) {
      for (const Case& c : cases) {
        INFO(dtype_name(dt) << " on " << device.str() << ", shape " << shape_str(c.shape) << ", "
                            << c.dims.size() << " dims");
        Tensor x = ops::to(ops::mul(randn(c.shape, 7), 3.0), dt).to(device);
        Tensor wide = ops::to(x, DType::F32);
        // The sum kept in f32 (mean's, sum_to's), and rounded to x's dtype.
        Tensor got = ops::sum(x, c.dims, c.keepdim, DType::F32), expect = ops::sum(wide, c.dims, c.keepdim);
        Tensor got16 = ops::sum(x, c.dims, c.keepdim);
        REQUIRE(got.dtype() == DType::F32);
        REQUIRE(got16.dtype() == dt);
        CHECK(got.shape() == expect.shape());
        CHECK(got.to(Device::cpu()).to_vector<float>() == expect.to(Device::cpu()).to_vector<float>());
        CHECK(ops::to(got16, DType::F32).to(Device::cpu()).to_vector<float>() ==
              ops::to(ops::to(expect, dt), DType::F32).to(Device::cpu()).to_vector<float>());
        CHECK(ops::to(ops::mean(x, c.dims, c.keepdim), DType::F32).to(Device::cpu()).to_vector<float>() ==
              ops::to(ops::to(ops::mean(wide, c.dims, c.keepdim), dt), DType::F32).to(Device::cpu()).to_vector<float>());
      }
    }
    // No f32 copy of x: a bias gradient's sum takes its f32 result and the
    // parts' sums, far less than the copy's 4 bytes an element.
    Tensor g = ops::to(randn({2048, 512}, 9), dt);
    reset_peak_memory_stats();
    const int64_t base = memory_stats().allocated_bytes;
    Tensor db = ops::sum(g, {0}, false, DType::F32);
    CHECK(memory_stats().peak_allocated_bytes - base < g.numel());
  }
  // The kernel's own check: a 16-bit sum goes into f32, nowhere else.
  Tensor x = ops::to(randn({4, 5}, 1), DType::BF16), out = empty({5}, DType::BF16);
  CHECK_THROWS_WITH(kernels(Device::cpu()).reduce(ReduceOp::Sum, out, x, 1, 4, 5),
                    Catch::Contains("bf16 values reduce into f32, got an output of bf16"));
}

namespace {

// The bits of a tensor's values widened to f32 (NaN payloads included).
std::vector<uint32_t> f32_bits(const Tensor& t) {
  std::vector<float> v = ops::to(t, DType::F32).to(Device::cpu()).to_vector<float>();
  std::vector<uint32_t> bits(v.size());
  if (!v.empty()) std::memcpy(bits.data(), v.data(), v.size() * sizeof(float));
  return bits;
}

}  // namespace

TEST_CASE("max, argmax and embedding gradients of bf16 and f16 read them where they lie", "[sums][dtype]") {
  struct Case {
    Shape shape;
    int64_t dim;
  };
  // Long and short rows, the middle dim, the first, one element per row.
  const std::vector<Case> cases = {{{1027, 300}, 1}, {{5, 40011}, 1}, {{3, 257, 7}, 1}, {{17, 33}, 0}, {{9, 1}, 1}};
  for (DType dt : {DType::BF16, DType::F16}) {
    for (Device device : {Device::cpu(), Device::async_cpu()}) {
      for (const Case& c : cases) {
        INFO(dtype_name(dt) << " on " << device.str() << ", shape " << shape_str(c.shape) << ", dim " << c.dim);
        // Few distinct values (ties everywhere: the first maximum wins), an
        // infinity, and NaN in some rows (NaN is the maximum).
        std::vector<float> host = randn(c.shape, 11).to_vector<float>();
        for (float& h : host) h = std::nearbyint(h * 2.0f) / 2.0f;
        for (size_t i = 0; i < host.size(); i += 97) host[i] = i % 2 == 0 ? INFINITY : NAN;
        Tensor x = ops::to(from_vector(host, c.shape), dt).to(device);
        Tensor wide = ops::to(x, DType::F32);
        auto [values, indices] = ops::max(x, c.dim, c.dim == 1);
        auto [expect_values, expect_indices] = ops::max(wide, c.dim, c.dim == 1);
        REQUIRE(values.dtype() == dt);
        CHECK(values.shape() == expect_values.shape());
        CHECK(f32_bits(values) == f32_bits(expect_values));
        CHECK(indices.to(Device::cpu()).to_vector<int64_t>() == expect_indices.to(Device::cpu()).to_vector<int64_t>());
        CHECK(ops::argmax(x, c.dim).to(Device::cpu()).to_vector<int64_t>() ==
              ops::argmax(wide, c.dim).to(Device::cpu()).to_vector<int64_t>());
      }
      // A token's gradient rows summed in f32 as they lie: the bits of the
      // widened copy's sums, rounded once. 37 rows hit by 2500 tokens (each
      // about 68 times: a bf16 sum would stop growing), an odd width.
      INFO(dtype_name(dt) << " embedding gradient on " << device.str());
      Tensor grad = ops::to(randn({2500, 131}, 12), dt).to(device);
      Tensor ids = randint({2500}, 0, 37, 13).to(device);
      Tensor gw = ops::embedding_backward(grad, ids, 37);
      Tensor expect = ops::embedding_backward(ops::to(grad, DType::F32), ids, 37);
      REQUIRE(gw.dtype() == dt);
      CHECK(f32_bits(gw) == f32_bits(ops::to(expect, dt)));
      // One token 2500 times, each gradient 1: 2500 in f32, rounded once (a
      // 16-bit running sum would stop growing at 256 in bf16, 2048 in f16).
      Tensor ones = ops::to(ops::add(zeros({2500, 3}), 1.0), dt).to(device);
      Tensor same = zeros({2500}, DType::I64).to(device);
      Tensor counted = ops::to(ops::embedding_backward(ones, same, 2), DType::F32).to(Device::cpu());
      const float expect_count = ops::to(ops::to(scalar_tensor(2500.0), dt), DType::F32).item();
      CHECK(counted.to_vector<float>() == std::vector<float>{expect_count, expect_count, expect_count, 0, 0, 0});
    }
    // No f32 copy: the maximum of a [2048, 512] gradient takes its values and
    // indices; an embedding gradient its f32 table, far less than the copy's
    // 4 bytes an element.
    Tensor x = ops::to(randn({2048, 512}, 14), dt);
    Tensor ids = randint({2048}, 0, 50, 15);
    reset_peak_memory_stats();
    const int64_t base = memory_stats().allocated_bytes;
    Tensor top = ops::max(x, 1).first, gw = ops::embedding_backward(x, ids, 50);
    CHECK(memory_stats().peak_allocated_bytes - base < x.numel());
  }
  // The kernel's own check: a 16-bit gradient sums into f32, nowhere else.
  Tensor grad = ops::to(randn({4, 5}, 1), DType::BF16), gw = zeros({3, 5}, DType::BF16);
  Tensor ids = from_vector(std::vector<int64_t>{0, 2, 2, 1}, {4});
  CHECK_THROWS_WITH(kernels(Device::cpu()).embedding_backward(gw, grad, ids),
                    Catch::Contains("a bf16 gradient sums into f32, got bf16"));
}
