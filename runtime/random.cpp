#include "runtime/random.h"

#include <cmath>

#include "runtime/cpu/dispatch.h"
#include "runtime/op_call.h"
#include "runtime/kernels.h"
#include "runtime/math.h"
#include "runtime/ops.h"
#include "runtime/parallel_for.h"

namespace tessera {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> key) {
  math::philox4x32(c.data(), key[0], key[1]);
  return c;
}

RandomSpec Generator::next(int64_t n) {
  RandomSpec spec{seed_, 0x64726f70u /* "drop" */, offset_, {}};
  offset_ += n;
  return spec;
}

Generator& default_generator() {
  thread_local Generator gen(0);
  return gen;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

uint64_t hash_name(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

namespace cpu {

namespace {
// Fills x (contiguous) with f(u0, u1) per element, counters from the spec's index map.
template <class F>
void fill_random(const Tensor& x, const RandomSpec& spec, F&& f) {
  const Shape& shape = x.shape();
  bool linear = spec.index_strides.empty() || spec.index_strides == contiguous_strides(shape);
  TS_CHECK(linear || spec.index_strides.size() == shape.size(),
           "random fill: index_strides {} do not match tensor shape {}",
           shape_str(spec.index_strides), shape_str(shape));
  dispatch_float(x.dtype(), "random fill", [&](auto tag) {
    using T = decltype(tag);
    T* p = x.data<T>();
    parallel_for(0, x.numel(), 4096, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        int64_t counter = spec.base;
        if (linear) {
          counter += i;
        } else {
          int64_t rem = i;
          for (size_t d = shape.size(); d-- > 0;) {
            counter += (rem % shape[d]) * spec.index_strides[d];
            rem /= shape[d];
          }
        }
        double u0, u1;
        math::draw_uniforms(spec.seed, spec.stream, static_cast<uint64_t>(counter), u0, u1);
        p[i] = static_cast<T>(f(u0, u1));
      }
    });
  });
}
}  // namespace

void uniform(const Tensor& x, double low, double high, const RandomSpec& spec) {
  fill_random(x, spec, [=](double u0, double) { return math::uniform_value(u0, low, high); });
}

void normal(const Tensor& x, double mean, double std, const RandomSpec& spec) {
  fill_random(x, spec, [=](double u0, double u1) { return math::normal_value(u0, u1, mean, std); });
}

}  // namespace cpu

namespace ops {

namespace {
// Runs a random fill on a contiguous float buffer, converting for bf16/f16 and
// copying back into non-contiguous targets.
template <class F>
void random_into(const Tensor& x, const char* what, F&& fill) {
  TS_CHECK(is_floating(x.dtype()), "{}: expected a floating-point tensor, got {}", what,
           dtype_name(x.dtype()));
  if (x.is_meta()) return;
  const DType cd = compute_dtype(x.device(), KernelFamily::Random, x.dtype());
  if (x.is_contiguous() && cd == x.dtype()) {
    fill(x);
    return;
  }
  Tensor tmp = empty(x.shape(), cd, x.device());
  fill(tmp);
  copy_(x, tmp);
}
}  // namespace

namespace {
// A subclass tensor fills its pieces, each element drawing the
// counter of its position in the whole tensor.
void random_subclass(OpId op, const Tensor& x, const RandomSpec& spec,
                     std::function<void(Tensor&, const RandomSpec&)> fill) {
  intercept({op, op_name(op), {x}, {.random = spec, .fill = std::move(fill)}});
}
}  // namespace

void uniform_(const Tensor& x, double low, double high, const RandomSpec& spec) {
  if (x.is_subclass())
    return random_subclass(OpId::uniform_, x, spec,
                              [=](Tensor& l, const RandomSpec& s) { uniform_(l, low, high, s); });
  random_into(x, "uniform_",
              [&](const Tensor& t) { dispatch(t.device()).uniform(t, low, high, spec); });
}

void normal_(const Tensor& x, double mean, double std, const RandomSpec& spec) {
  if (x.is_subclass())
    return random_subclass(OpId::normal_, x, spec,
                              [=](Tensor& l, const RandomSpec& s) { normal_(l, mean, std, s); });
  random_into(x, "normal_",
              [&](const Tensor& t) { dispatch(t.device()).normal(t, mean, std, spec); });
}

Tensor dropout_mask(const Tensor& like, double p, const RandomSpec& spec) {
  TS_CHECK(p >= 0.0 && p < 1.0, "dropout: probability must be in [0, 1), got {}", p);
  // Uniforms in f32, laid out as `like` (a subclass tensor's own layout comes from empty_like).
  Tensor u = like.is_subclass() ? to(empty_like(like), DType::F32)
                                   : empty(like.shape(), DType::F32, like.device());
  uniform_(u, 0.0, 1.0, spec);
  return where(binary(BinaryOp::Ge, u, p), full({}, 1.0 / (1.0 - p), like.dtype(), like.device()),
               full({}, 0.0, like.dtype(), like.device()));
}

}  // namespace ops

// ---- factories -------------------------------------------------------------------

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  ops::fill_(t, value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor zeros_like(const Tensor& x) {
  if (x.is_subclass())
    return intercept_one({OpId::zeros_like, "zeros_like", {x}, {},
                          [](const TensorList& l) { return TensorList{zeros_like(l[0])}; }});
  return zeros(x.shape(), x.dtype(), x.device());
}
Tensor empty_like(const Tensor& x) {
  if (x.is_subclass())
    return intercept_one({OpId::empty_like, "empty_like", {x}, {},
                          [](const TensorList& l) { return TensorList{empty_like(l[0])}; }});
  return empty(x.shape(), x.dtype(), x.device());
}
Tensor scalar_tensor(double value, DType dtype, Device device) { return full({}, value, dtype, device); }

Tensor arange(int64_t start, int64_t end, int64_t step, DType dtype, Device device) {
  TS_CHECK(step != 0, "arange: step must be nonzero");
  int64_t n = std::max<int64_t>(0, (end - start + step - (step > 0 ? 1 : -1)) / step);
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<double>(start + i * step);
  return ops::to(ops::to(from_vector(values, {n}), dtype), device);
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  TS_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
           "from_vector: {} values cannot fill shape {} ({} elements)", values.size(),
           shape_str(shape), shape_numel(shape));
  Tensor t = empty(shape, DTypeOf<T>::value);
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(T));
  return ops::to(t, device);
}
template Tensor from_vector<float>(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector<int32_t>(const std::vector<int32_t>&, const Shape&, Device);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, Device);

Tensor uniform(const Shape& shape, double low, double high, uint64_t seed, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  ops::uniform_(t, low, high, {seed, 0, 0, {}});
  return t;
}
Tensor normal(const Shape& shape, double mean, double std, uint64_t seed, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  ops::normal_(t, mean, std, {seed, 0, 0, {}});
  return t;
}
Tensor rand(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  return uniform(shape, 0.0, 1.0, seed, dtype, device);
}
Tensor randn(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  return normal(shape, 0.0, 1.0, seed, dtype, device);
}

Tensor randint(const Shape& shape, int64_t low, int64_t high, uint64_t seed, Device device) {
  TS_CHECK(high > low, "randint: empty range [{}, {})", low, high);
  Tensor u = uniform(shape, 0.0, 1.0, seed, DType::F64);
  std::vector<double> v = u.to_vector<double>();
  std::vector<int64_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = low + std::min<int64_t>(high - low - 1, static_cast<int64_t>(v[i] * static_cast<double>(high - low)));
  return from_vector(out, shape, device);
}

}  // namespace tessera
