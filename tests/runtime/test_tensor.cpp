#include <atomic>
#include <cstring>
#include <functional>

#include "runtime/allocator.h"
#include "runtime/cuda_backend.h"
#include "runtime/parallel_for.h"
#include "runtime/stream.h"
#include "tests/helpers.h"

using namespace tessera;
using tessera::testing::allclose;
using tessera::testing::equal;

namespace {
// Element (i, j) of a 2-D tensor read through its strides.
double at(const Tensor& t, std::vector<int64_t> idx) {
  int64_t off = t.storage_offset();
  for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t.strides()[d];
  return static_cast<double>(static_cast<float*>(t.storage()->data())[off]);
}
}  // namespace

TEST_CASE("views share storage and follow strides", "[tensor][views]") {
  Tensor x = ops::reshape(arange(0, 24, 1, DType::F32), {2, 3, 4});
  CHECK(x.is_contiguous());
  CHECK(x.strides() == Shape{12, 4, 1});

  Tensor t = ops::transpose(x, 0, 2);
  CHECK(t.shape() == Shape{4, 3, 2});
  CHECK(t.strides() == Shape{1, 4, 12});
  CHECK_FALSE(t.is_contiguous());
  CHECK(t.storage() == x.storage());
  CHECK(at(t, {3, 1, 1}) == 12 + 4 + 3);

  Tensor p = ops::permute(x, {1, 2, 0});
  CHECK(p.shape() == Shape{3, 4, 2});
  CHECK(at(p, {2, 1, 1}) == 12 + 8 + 1);

  Tensor n = ops::narrow(x, 1, 1, 2);
  CHECK(n.shape() == Shape{2, 2, 4});
  CHECK(n.storage_offset() == 4);
  CHECK(at(n, {1, 0, 0}) == 16);

  Tensor s = ops::slice(x, 2, 1, 4, 2);
  CHECK(s.shape() == Shape{2, 3, 2});
  CHECK(s.to_vector<float>() ==
        std::vector<float>{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23});

  Tensor e = ops::expand(ops::reshape(arange(0, 3, 1, DType::F32), {3, 1}), {2, 3, 5});
  CHECK(e.strides() == Shape{0, 1, 0});
  CHECK(e.to_vector<float>()[7] == 1.0f);

  Tensor u = ops::unsqueeze(x, 1);
  CHECK(u.shape() == Shape{2, 1, 3, 4});
  CHECK(ops::squeeze(u, 1).shape() == x.shape());
  CHECK(ops::squeeze(ops::reshape(x, {1, 2, 1, 12})).shape() == Shape{2, 12});

  // Writes through a view are visible in the base.
  Tensor col = ops::select(x, 2, 3);
  ops::fill_(col, -1.0);
  CHECK(x.to_vector<float>()[3] == -1.0f);
  CHECK(x.to_vector<float>()[23] == -1.0f);

  // contiguous() copies a non-contiguous view into row-major order.
  Tensor c = ops::contiguous(t);
  CHECK(c.is_contiguous());
  CHECK(c.storage() != x.storage());
  CHECK(equal(c, t));
}

TEST_CASE("view vs reshape on non-contiguous inputs", "[tensor][views]") {
  Tensor x = randn({4, 6}, 1);
  Tensor t = ops::transpose(x, 0, 1);  // [6, 4] col-major
  CHECK_THROWS_WITH(ops::view(t, {24}), Catch::Contains("use reshape"));
  Tensor r = ops::reshape(t, {24});
  CHECK(r.storage() != x.storage());
  CHECK(equal(r, ops::contiguous(t).to_vector<float>().size() == 24 ? ops::view(ops::contiguous(t), {24}) : r));
  // A view that only splits a dim works on the transposed tensor.
  Tensor v = ops::view(t, {2, 3, 4});
  CHECK(v.storage() == x.storage());
  CHECK(equal(ops::contiguous(v), ops::view(ops::contiguous(t), {2, 3, 4})));
  CHECK(ops::view(x, {-1, 3}).shape() == Shape{8, 3});
  CHECK_THROWS_WITH(ops::view(x, {5, -1}), Catch::Contains("invalid for input of size 24"));
  CHECK_THROWS_WITH(ops::view(x, {-1, -1}), Catch::Contains("only one dimension can be -1"));
}

TEST_CASE("broadcasting follows numpy rules", "[tensor][broadcast]") {
  Tensor a = randn({3, 1, 5}, 2);
  Tensor b = randn({4, 1}, 3);
  Tensor c = ops::add(a, b);
  CHECK(c.shape() == Shape{3, 4, 5});
  auto va = a.to_vector<float>(), vb = b.to_vector<float>(), vc = c.to_vector<float>();
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 5; ++k) CHECK(vc[(i * 4 + j) * 5 + k] == va[i * 5 + k] + vb[j]);
  CHECK_THROWS_WITH(ops::add(randn({3, 2}, 1), randn({3}, 1)),
                    Catch::Contains("shapes [3, 2] and [3] cannot be broadcast"));
  CHECK_THROWS_WITH(ops::add(randn({3}, 1), randn({3}, 1, DType::F64)),
                    Catch::Contains("dtype mismatch (f32 and f64)"));
  // sum_to reverses broadcasting.
  Tensor g = ops::sum_to(ones({3, 4, 5}), {4, 1});
  CHECK(g.shape() == Shape{4, 1});
  CHECK(g.to_vector<float>() == std::vector<float>(4, 15.0f));
}

TEST_CASE("cat, stack, split and chunk", "[tensor]") {
  Tensor a = randn({2, 3}, 1), b = randn({4, 3}, 2);
  Tensor c = ops::cat({a, b}, 0);
  CHECK(c.shape() == Shape{6, 3});
  CHECK(equal(ops::narrow(c, 0, 2, 4), b));
  Tensor s = ops::stack({a, a}, 1);
  CHECK(s.shape() == Shape{2, 2, 3});
  CHECK(equal(ops::select(s, 1, 1), a));
  CHECK_THROWS_WITH(ops::cat({a, randn({2, 4}, 1)}, 0), Catch::Contains("may differ only in dim 0"));

  // torch.chunk semantics: 17 rows in 4 chunks -> 5,5,5,2; 5 in 4 -> 2,2,1 (three chunks).
  auto sizes = [](const std::vector<Tensor>& parts) {
    std::vector<int64_t> out;
    for (auto& p : parts) out.push_back(p.size(0));
    return out;
  };
  CHECK(sizes(ops::chunk(randn({17, 2}, 1), 4)) == std::vector<int64_t>{5, 5, 5, 2});
  CHECK(sizes(ops::chunk(randn({5}, 1), 4)) == std::vector<int64_t>{2, 2, 1});
  CHECK(sizes(ops::split(randn({7}, 1), 3)) == std::vector<int64_t>{3, 3, 1});
  CHECK(sizes(ops::split_with_sizes(randn({7}, 1), {1, 0, 6})) == std::vector<int64_t>{1, 0, 6});
}

TEST_CASE("reductions over dims", "[tensor][reduce]") {
  for (Shape shape : {Shape{1}, Shape{3, 17}, Shape{17, 3, 5}, Shape{257, 2}}) {
    Tensor x = randn(shape, 11, DType::F64);
    auto v = x.to_vector<double>();
    // Full sum.
    double total = 0;
    for (double e : v) total += e;
    CHECK(ops::sum(x).item() == Approx(total).epsilon(1e-12));
    // Sum over dim 0 and the last dim against loops.
    int64_t n0 = shape[0], rest = x.numel() / n0;
    Tensor s0 = ops::sum(x, {0});
    auto vs0 = s0.to_vector<double>();
    for (int64_t j = 0; j < rest; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < n0; ++i) acc += v[i * rest + j];
      CHECK(vs0[j] == Approx(acc).epsilon(1e-12));
    }
    Tensor m = ops::mean(x, {-1}, true);
    CHECK(m.dim() == x.dim());
    int64_t last = shape.back();
    auto vm = m.to_vector<double>();
    for (int64_t r = 0; r < x.numel() / last; ++r) {
      double acc = 0;
      for (int64_t j = 0; j < last; ++j) acc += v[r * last + j];
      CHECK(vm[r] == Approx(acc / last).epsilon(1e-12));
    }
  }
  // Non-adjacent dims, max/argmax, var.
  Tensor x = randn({4, 5, 6}, 5);
  Tensor s = ops::sum(x, {0, 2});
  Tensor ref = ops::sum(ops::sum(x, {2}), {0});
  CHECK(allclose(s, ref, 1e-6, 1e-5));
  auto [vals, idx] = ops::max(x, 1);
  CHECK(vals.shape() == Shape{4, 6});
  auto vx = x.to_vector<float>();
  auto vv = vals.to_vector<float>();
  auto vi = idx.to_vector<int64_t>();
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 6; ++k) {
      float best = -1e30f;
      int64_t arg = -1;
      for (int j = 0; j < 5; ++j)
        if (vx[(i * 5 + j) * 6 + k] > best) best = vx[(i * 5 + j) * 6 + k], arg = j;
      CHECK(vv[i * 6 + k] == best);
      CHECK(vi[i * 6 + k] == arg);
    }
  Tensor var = ops::var(x, {1});
  Tensor mu = ops::mean(x, {1}, true);
  Tensor manual = ops::mul(ops::sum(ops::mul(ops::sub(x, mu), ops::sub(x, mu)), {1}), 1.0 / 4);
  CHECK(allclose(var, manual, 1e-5, 1e-6));
  CHECK(ops::sum(from_vector<int64_t>({1, 2, 3}, {3})).dtype() == DType::I64);
}

TEST_CASE("matmul agrees with a naive f64 loop, including transposed views", "[tensor][matmul]") {
  for (auto [m, k, n] : {std::tuple{1, 1, 1}, {3, 17, 5}, {17, 3, 257}, {64, 65, 3}}) {
    Tensor a = randn({m, k}, 1, DType::F64), b = randn({k, n}, 2, DType::F64);
    auto va = a.to_vector<double>(), vb = b.to_vector<double>();
    std::vector<double> ref(static_cast<size_t>(m * n), 0.0);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j)
        for (int p = 0; p < k; ++p) ref[i * n + j] += va[i * k + p] * vb[p * n + j];
    Tensor r = from_vector(ref, {m, n});
    CHECK(allclose(ops::matmul(a, b), r, 1e-12, 1e-12));
    // Same product through transposed storage: (b^T)^T and (a^T)^T.
    Tensor at = ops::contiguous(ops::transpose(a, 0, 1));
    Tensor bt = ops::contiguous(ops::transpose(b, 0, 1));
    CHECK(allclose(ops::matmul(ops::transpose(at, 0, 1), ops::transpose(bt, 0, 1)), r, 1e-12, 1e-12));
    CHECK(allclose(ops::matmul(ops::to(a, DType::F32), ops::to(b, DType::F32)), r, 1e-5, 1e-4));
  }
  // Batched with broadcasting: [2, 1, 3, 4] @ [5, 4, 2] -> [2, 5, 3, 2].
  Tensor a = randn({2, 1, 3, 4}, 3), b = randn({5, 4, 2}, 4);
  Tensor c = ops::matmul(a, b);
  CHECK(c.shape() == Shape{2, 5, 3, 2});
  Tensor c12 = ops::matmul(ops::select(ops::select(a, 0, 1), 0, 0), ops::select(b, 0, 2));
  CHECK(allclose(ops::select(ops::select(c, 0, 1), 0, 2), c12, 1e-6, 1e-6));
  // Vector cases.
  Tensor v = randn({4}, 5);
  CHECK(ops::matmul(v, v).dim() == 0);
  CHECK(ops::matmul(randn({3, 4}, 1), v).shape() == Shape{3});
  CHECK_THROWS_WITH(ops::matmul(randn({4, 3}, 1), randn({5, 2}, 1)),
                    Catch::Contains("shapes [4, 3] and [5, 2] do not align (3 != 5)"));
}

TEST_CASE("random slices equal the slice of the full tensor", "[tensor][random]") {
  Shape full_shape{17, 13};
  Tensor full_t = empty(full_shape);
  ops::normal_(full_t, 0.0, 1.0, {42, 7, 0, {}});
  for (int64_t world : {1, 2, 3, 4}) {
    for (int64_t r = 0; r < world; ++r) {
      // Row shard r of `world` (torch.chunk semantics).
      int64_t c = (17 + world - 1) / world, start = std::min<int64_t>(17, r * c);
      int64_t len = std::min<int64_t>(17, start + c) - start;
      Tensor shard = empty({len, 13});
      ops::normal_(shard, 0.0, 1.0, {42, 7, start * 13, {}});
      CHECK(equal(shard, ops::narrow(full_t, 0, start, len)));
      // Column shard via index strides.
      int64_t cc = (13 + world - 1) / world, cs = std::min<int64_t>(13, r * cc);
      int64_t cl = std::min<int64_t>(13, cs + cc) - cs;
      Tensor cshard = empty({17, cl});
      ops::normal_(cshard, 0.0, 1.0, {42, 7, cs, {13, 1}});
      CHECK(equal(cshard, ops::narrow(full_t, 1, cs, cl)));
    }
  }
  // Moments of a large sample; different seeds and streams differ.
  Tensor big = normal({200000}, 1.0, 2.0, 9);
  CHECK(ops::mean(big).item() == Approx(1.0).margin(0.02));
  CHECK(std::sqrt(ops::var(big).item()) == Approx(2.0).margin(0.02));
  Tensor u = rand({100000}, 3);
  CHECK(ops::max(u).item() < 1.0);
  CHECK(-ops::max(ops::neg(u)).item() >= 0.0);
  CHECK_FALSE(equal(rand({8}, 3), rand({8}, 4)));
}

TEST_CASE("allocator tracks current and peak bytes; storage can be released", "[tensor][memory]") {
  MemoryStats before = memory_stats();
  reset_peak_memory_stats();
  {
    Tensor a = empty({1000}, DType::F32);
    CHECK(memory_stats().allocated_bytes == before.allocated_bytes + 4000);
    Tensor b = empty({500}, DType::F64);
    CHECK(memory_stats().peak_allocated_bytes >= before.allocated_bytes + 8000);
    Tensor view = ops::narrow(a, 0, 10, 10);
    a.storage()->release();
    CHECK(memory_stats().allocated_bytes == before.allocated_bytes + 4000);
    CHECK_THROWS_WITH(view.data_ptr(), Catch::Contains("has been released"));
    a.storage()->allocate();
    ops::fill_(view, 3.0);  // the same view object works again
    CHECK(a.to_vector<float>()[15] == 3.0f);
  }
  CHECK(memory_stats().allocated_bytes == before.allocated_bytes);
}

TEST_CASE("meta tensors have shapes and no bytes", "[tensor][meta]") {
  MemoryStats before = memory_stats();
  Tensor m = empty({1024, 1024}, DType::F32, Device::meta());
  Tensor y = ops::matmul(m, ops::transpose(m, 0, 1));
  CHECK(y.shape() == Shape{1024, 1024});
  CHECK(y.is_meta());
  CHECK(memory_stats().allocated_bytes == before.allocated_bytes);
  CHECK_THROWS_WITH(m.data_ptr(), Catch::Contains("meta device"));
  Tensor cpu = zeros({2});
  CHECK_THROWS_WITH(ops::add(cpu, empty({2}, DType::F32, Device::meta())),
                    Catch::Contains("different devices (cpu and meta)"));
}


TEST_CASE("CPU streams and events: in-order host execution", "[tensor][stream]") {
  Stream& s = current_stream(Device::cpu());
  CHECK(s.device().is_cpu());
  auto ev = make_event(Device::cpu());
  Tensor x = zeros({4});
  ops::fill_(x, 2.0);
  ev->record(s);
  CHECK(ev->query());  // the fill ran before the record returned
  ev->wait(s);
  s.synchronize();
  CHECK(x.to_vector<float>()[3] == 2.0f);
  if (!cuda::is_available())  // a build without CUDA, no driver or no GPU: said (why), not crashed
    CHECK_THROWS_WITH(current_stream(Device::cuda(0)),
                      Catch::Contains("cuda:0: " + cuda::unavailable_reason()) &&
                          (Catch::Contains("no CUDA device is visible") || Catch::Contains("no CUDA backend") ||
                           Catch::Contains("no NVIDIA driver")));
  // The meta device's streams are synchronous, like the CPU's (a step planned
  // on meta takes the CPU's paths), and do not mix with the CPU's events.
  Stream& meta = current_stream(Device::meta());
  CHECK(meta.synchronous());
  CHECK(meta.device() == Device::meta());
  CHECK_THROWS_WITH(make_event(Device::cpu())->record(meta),
                    Catch::Contains("a cpu event cannot be recorded on a meta stream"));
}

TEST_CASE("matmul with empty dims", "[tensor][matmul]") {
  CHECK(ops::matmul(randn({3, 4, 8}, 1), randn({8, 0}, 2)).shape() == Shape{3, 4, 0});
  CHECK(ops::matmul(randn({0, 8}, 1), randn({8, 5}, 2)).shape() == Shape{0, 5});
  Tensor z = ops::matmul(randn({2, 0}, 1), randn({0, 3}, 2));
  CHECK(testing::equal(z, zeros({2, 3})));
}

TEST_CASE("uniform: random slices equal the slice of the full tensor", "[tensor][random]") {
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    Tensor full_t = empty({17, 13}, dt);
    ops::uniform_(full_t, -2.0, 3.0, {42, 7, 0, {}});
    auto vf = full_t.to_vector<double>();
    for (double v : vf) {
      CHECK(v >= -2.0);
      CHECK(v < 3.0);
    }
    for (int64_t world : {1, 2, 3, 4}) {
      for (int64_t r = 0; r < world; ++r) {
        int64_t c = (17 + world - 1) / world, start = std::min<int64_t>(17, r * c);
        int64_t len = std::min<int64_t>(17, start + c) - start;
        Tensor shard = empty({len, 13}, dt);
        ops::uniform_(shard, -2.0, 3.0, {42, 7, start * 13, {}});
        CHECK(equal(shard, ops::narrow(full_t, 0, start, len)));
        int64_t cc = (13 + world - 1) / world, cs = std::min<int64_t>(13, r * cc);
        int64_t cl = std::min<int64_t>(13, cs + cc) - cs;
        Tensor cshard = empty({17, cl}, dt);
        ops::uniform_(cshard, -2.0, 3.0, {42, 7, cs, {13, 1}});
        CHECK(equal(cshard, ops::narrow(full_t, 1, cs, cl)));
      }
    }
    // Another stream or seed gives other numbers; the same spec the same ones.
    Tensor again = empty({17, 13}, dt), other = empty({17, 13}, dt);
    ops::uniform_(again, -2.0, 3.0, {42, 7, 0, {}});
    ops::uniform_(other, -2.0, 3.0, {42, 8, 0, {}});
    CHECK(equal(again, full_t));
    CHECK_FALSE(equal(other, full_t));
  }
  Tensor u = uniform({100000}, -2.0, 3.0, 11);
  CHECK(ops::mean(u).item() == Approx(0.5).margin(0.02));
  CHECK(ops::var(u).item() == Approx(25.0 / 12).margin(0.03));
}

// ---- in-place ops ------------------------------------------------------------------------

namespace {
// A [m, n] target laid out three ways, each inside a base tensor: the whole
// contiguous base, a transposed view of an [n, m] base, and every other column of
// an [m, 2n + 1] base (offset 1). The base shows what the op must leave alone.
struct Target {
  const char* layout;
  Tensor base, view;
};
std::vector<Target> targets(int64_t m, int64_t n, DType dtype, uint64_t seed) {
  Tensor c = ops::to(randn({m, n}, seed, DType::F64), dtype);
  Tensor t = ops::to(randn({n, m}, seed + 1, DType::F64), dtype);
  Tensor s = ops::to(randn({m, 2 * n + 1}, seed + 2, DType::F64), dtype);
  return {{"contiguous", c, c},
          {"transposed", t, ops::transpose(t, 0, 1)},
          {"strided slice", s, ops::slice(s, 1, 1, 2 * n + 1, 2)}};
}

// The base's old values with the view's elements replaced by `expect` (row-major
// over the 2-D view), located through the view's strides.
std::vector<double> through_view(const Tensor& view, std::vector<double> base,
                                 const std::vector<double>& expect) {
  int64_t m = view.size(0), n = view.size(1);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      base[static_cast<size_t>(view.storage_offset() + i * view.strides()[0] +
                               j * view.strides()[1])] = expect[static_cast<size_t>(i * n + j)];
  return base;
}

// Operand `k` of a family for a [m, n] target: same shape non-contiguous, a row [n],
// a column [m, 1], a 0-dim scalar. Magnitudes in [0.5, 2], random signs when `signed_`.
Tensor operand(int64_t k, int64_t m, int64_t n, DType dtype, uint64_t seed, bool signed_ = true) {
  std::vector<Shape> shapes = {{n, m}, {n}, {m, 1}, {}};
  Shape s = shapes[static_cast<size_t>(k % 4)];
  Tensor v = uniform(s, 0.5, 2.0, seed, DType::F64);
  if (signed_) {  // times +-1
    Tensor positive =
        ops::to(ops::binary(ops::BinaryOp::Gt, randn(s, seed + 9, DType::F64), 0.0), DType::F64);
    v = ops::mul(v, ops::add(ops::mul(positive, 2.0), -1.0));
  }
  v = ops::to(v, dtype);
  return k % 4 == 0 ? ops::transpose(v, 0, 1) : v;
}

// The operand's values broadcast to [m, n], row-major.
std::vector<double> broadcast_values(const Tensor& o, int64_t m, int64_t n) {
  return ops::expand(o, {m, n}).to_vector<double>();
}

// f64: rounding; f32: a few ulp; bf16: computed in f32, rounded once (half an ulp is 2^-9).
double rtol_for(DType dt) {
  return dt == DType::F64 ? 1e-14 : dt == DType::F32 ? 2e-6 : 4e-3;
}
double atol_for(DType dt) {
  return dt == DType::F64 ? 1e-14 : dt == DType::F32 ? 2e-6 : 1e-5;
}
}  // namespace

TEST_CASE("in-place updates on contiguous and strided views against f64", "[tensor][inplace]") {
  using Update = std::function<void(Tensor&, const Tensor&, const Tensor&)>;
  using Ref = std::function<double(double, double, double)>;
  struct Case {
    const char* name;
    Update update;
    Ref ref;
    bool positive_b = false;  // the second operand is a divisor
  };
  std::vector<Case> cases = {
      {"add_ alpha", [](Tensor& x, const Tensor& a, const Tensor&) { ops::add_(x, a, -0.75); },
       [](double x, double a, double) { return x - 0.75 * a; }},
      {"add_ scalar", [](Tensor& x, const Tensor&, const Tensor&) { ops::add_(x, 1.25); },
       [](double x, double, double) { return x + 1.25; }},
      {"mul_", [](Tensor& x, const Tensor& a, const Tensor&) { ops::mul_(x, a); },
       [](double x, double a, double) { return x * a; }},
      {"mul_ scalar", [](Tensor& x, const Tensor&, const Tensor&) { ops::mul_(x, -0.375); },
       [](double x, double, double) { return x * -0.375; }},
      {"div_", [](Tensor& x, const Tensor& a, const Tensor&) { ops::div_(x, a); },
       [](double x, double a, double) { return x / a; }},
      {"lerp_", [](Tensor& x, const Tensor& a, const Tensor&) { ops::lerp_(x, a, 0.3); },
       [](double x, double a, double) { return x + 0.3 * (a - x); }},
      {"addcmul_",
       [](Tensor& x, const Tensor& a, const Tensor& b) { ops::addcmul_(x, a, b, -0.4); },
       [](double x, double a, double b) { return x - 0.4 * a * b; }},
      {"addcdiv_", [](Tensor& x, const Tensor& a, const Tensor& b) { ops::addcdiv_(x, a, b, 0.7); },
       [](double x, double a, double b) { return x + 0.7 * a / b; }, true},
      {"clamp_ both", [](Tensor& x, const Tensor&, const Tensor&) { ops::clamp_(x, -0.5, 0.8); },
       [](double x, double, double) { return std::min(std::max(x, -0.5), 0.8); }},
      {"clamp_ min",
       [](Tensor& x, const Tensor&, const Tensor&) { ops::clamp_(x, 0.1, std::nullopt); },
       [](double x, double, double) { return std::max(x, 0.1); }},
      {"clamp_ max",
       [](Tensor& x, const Tensor&, const Tensor&) { ops::clamp_(x, std::nullopt, -0.2); },
       [](double x, double, double) { return std::min(x, -0.2); }},
      {"fill_", [](Tensor& x, const Tensor&, const Tensor&) { ops::fill_(x, -3.5); },
       [](double, double, double) { return -3.5; }},
      {"zero_", [](Tensor& x, const Tensor&, const Tensor&) { ops::zero_(x); },
       [](double, double, double) { return 0.0; }},
  };
  int64_t k = 0;
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {257, 3}}) {
    for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
      for (auto& c : cases) {
        for (auto& tg : targets(m, n, dt, static_cast<uint64_t>(m * n + k))) {
          ++k;
          INFO(c.name << " on " << tg.layout << " [" << m << ", " << n << "] " << dtype_name(dt)
                      << " operand kind " << k % 4);
          Tensor a = operand(k, m, n, dt, static_cast<uint64_t>(k));
          Tensor b = operand(k + 1, m, n, dt, static_cast<uint64_t>(k + 100), !c.positive_b);
          auto va = broadcast_values(a, m, n), vb = broadcast_values(b, m, n);
          auto vx = tg.view.to_vector<double>(), vbase = tg.base.to_vector<double>();
          std::vector<double> expect(vx.size());
          for (size_t i = 0; i < vx.size(); ++i) expect[i] = c.ref(vx[i], va[i], vb[i]);
          std::vector<double> want = through_view(tg.view, vbase, expect);
          c.update(tg.view, a, b);
          CHECK(tg.view.dtype() == dt);
          CHECK_CLOSE(tg.base, from_vector(want, tg.base.shape()), rtol_for(dt), atol_for(dt));
        }
      }
      // sqrt_ on positive values.
      for (auto& tg : targets(m, n, dt, static_cast<uint64_t>(k++))) {
        INFO("sqrt_ on " << tg.layout << " " << dtype_name(dt));
        Tensor ab =
            ops::to(ops::add(ops::unary(ops::UnaryOp::Abs, ops::to(tg.base, DType::F64)), 0.1), dt);
        Tensor view =
            ops::as_strided(ab, tg.view.shape(), tg.view.strides(), tg.view.storage_offset());
        auto vx = view.to_vector<double>();
        for (double& v : vx) v = std::sqrt(v);
        std::vector<double> want = through_view(view, ab.to_vector<double>(), vx);
        ops::sqrt_(view);
        CHECK_CLOSE(ab, from_vector(want, ab.shape()), rtol_for(dt), atol_for(dt));
      }
    }
  }
  // The operand may broadcast to the target, never the target grow; dtypes must match.
  Tensor x = zeros({3});
  CHECK_THROWS_WITH(ops::add_(x, zeros({2, 3})),
                    Catch::Contains("does not broadcast to the target's shape"));
  CHECK_THROWS_WITH(ops::mul_(x, zeros({3}, DType::F64)),
                    Catch::Contains("dtype mismatch (f64 into f32)"));
  Tensor xi = zeros({3}, DType::I64);
  CHECK_THROWS_WITH(ops::sqrt_(xi), Catch::Contains("expected a floating-point tensor"));
}

namespace {
// Round-to-nearest-even f32 -> bf16, returned as the f64 value it represents.
double bf16_round(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
}  // namespace

TEST_CASE("copy_ broadcasts and converts dtypes into strided views", "[tensor][inplace][copy]") {
  struct Conv {
    DType src, dst;
    double (*ref)(double);
  };
  std::vector<Conv> convs = {
      {DType::F64, DType::F64, [](double v) { return v; }},
      {DType::F32, DType::F64, [](double v) { return v; }},
      {DType::F64, DType::F32, [](double v) { return static_cast<double>(static_cast<float>(v)); }},
      {DType::F64, DType::BF16, [](double v) { return bf16_round(static_cast<float>(v)); }},
      {DType::F32, DType::BF16, [](double v) { return bf16_round(static_cast<float>(v)); }},
      {DType::BF16, DType::F32, [](double v) { return v; }},
      {DType::F64, DType::I64, [](double v) { return std::trunc(v); }},  // toward zero, as PyTorch
      {DType::I64, DType::F32, [](double v) { return v; }},
      {DType::F32, DType::Bool, [](double v) { return v != 0 ? 1.0 : 0.0; }},
      {DType::Bool, DType::F64, [](double v) { return v; }},
  };
  int64_t k = 0;
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {257, 3}}) {
    for (auto& cv : convs) {
      for (auto& tg : targets(m, n, DType::F64, static_cast<uint64_t>(k))) {
        ++k;
        INFO(dtype_name(cv.src) << " -> " << dtype_name(cv.dst) << " on " << tg.layout << " [" << m
                                << ", " << n << "] source kind " << k % 4);
        Tensor base = ops::to(tg.base, cv.dst);
        Tensor view =
            ops::as_strided(base, tg.view.shape(), tg.view.strides(), tg.view.storage_offset());
        // Source values with fractions and both signs (some exact zeros for bool).
        Tensor src = ops::mul(operand(k, m, n, DType::F64, static_cast<uint64_t>(k)), 3.0);
        if (k % 3 == 0)
          src = ops::mul(src, ops::to(ops::binary(ops::BinaryOp::Gt, src, 0.0), DType::F64));
        src = ops::to(src, cv.src);
        auto vs = broadcast_values(src, m, n);
        std::vector<double> expect(vs.size());
        for (size_t i = 0; i < vs.size(); ++i) expect[i] = cv.ref(vs[i]);
        std::vector<double> want = through_view(view, base.to_vector<double>(), expect);
        ops::copy_(view, src);
        CHECK(view.dtype() == cv.dst);
        CHECK(base.to_vector<double>() == want);  // conversions are exact functions
      }
    }
  }
  Tensor x = zeros({2, 3});
  CHECK_THROWS_WITH(ops::copy_(x, zeros({4})), Catch::Contains("[4]"));
}

TEST_CASE("parallel_for rethrows a worker thread's exception on the caller", "[parallel]") {
  int saved = num_threads();
  set_num_threads(2);
  std::atomic<int> ran{0};
  // Every range throws; the first exception reaches the caller, after all ranges ran.
  CHECK_THROWS_WITH(parallel_for(0, 1000, 1,
                                 [&](int64_t b, int64_t) {
                                   ran++;
                                   TS_CHECK(false, "range at {} failed", b);
                                 }),
                    Catch::Contains("failed"));
  CHECK(ran.load() >= 1);
  // And a loop that does not throw still works afterwards.
  std::atomic<int64_t> sum{0};
  parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) { sum += e - b; });
  CHECK(sum.load() == 1000);
  set_num_threads(saved);
}

TEST_CASE("a permuted tensor made contiguous: every element where its index says, in every element size",
          "[tensor][copy]") {
  // Shapes that cross the transposing copy's 32 x 32 tiles unevenly, with
  // the unit-stride dim moved to every place, a narrow view, and a shape too
  // small for tiles (the element loop).
  struct Case {
    Shape shape;
    std::vector<int64_t> perm;
  };
  const std::vector<Case> cases = {{{67, 45}, {1, 0}},          {{3, 40, 33}, {0, 2, 1}}, {{40, 3, 35}, {2, 1, 0}},
                                   {{2, 33, 5, 47}, {3, 0, 2, 1}}, {{5, 7}, {1, 0}},       {{1, 64, 1, 40}, {3, 2, 1, 0}}};
  for (DType dt : {DType::F32, DType::BF16, DType::F64, DType::I64, DType::F16}) {
    for (const Case& c : cases) {
      INFO(dtype_name(dt) << " " << shape_str(c.shape));
      Tensor x = ops::to(ops::mul(randn(c.shape, 5), 100.0), dt);
      Tensor p = ops::permute(x, c.perm), got = ops::contiguous(p);
      REQUIRE(got.is_contiguous());
      const std::vector<double> xs = ops::to(x, DType::F64).to_vector<double>(), gs = ops::to(got, DType::F64).to_vector<double>();
      // Walk got's elements in order; find each in x through the permutation.
      const Shape& ps = p.shape();
      std::vector<int64_t> idx(ps.size(), 0);
      bool all = true;
      for (size_t flat = 0; flat < gs.size(); ++flat) {
        int64_t at = 0;
        for (size_t d = 0; d < ps.size(); ++d) at += idx[d] * x.stride(c.perm[d]);
        all = all && gs[flat] == xs[static_cast<size_t>(at)];
        for (int64_t d = static_cast<int64_t>(ps.size()) - 1; d >= 0 && ++idx[d] == ps[d]; --d) idx[d] = 0;
      }
      CHECK(all);
    }
    // Into a view of a larger tensor (dst not contiguous: the element loop).
    Tensor big = zeros({70, 50}, dt), part = ops::narrow(big, 1, 3, 45);
    Tensor src = ops::to(randn({45, 70}, 6), dt);
    ops::copy_(part, ops::transpose(src, 0, 1));
    CHECK(ops::to(part, DType::F64).to_vector<double>() ==
          ops::to(ops::contiguous(ops::transpose(src, 0, 1)), DType::F64).to_vector<double>());
  }
}
