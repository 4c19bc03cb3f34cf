// Differentiable elementwise math and reductions.
#include "autograd/functions.h"
#include "runtime/profiler.h"

namespace tessera {

using autograd::record;
using autograd::should_record;
using ops::BinaryOp;
using ops::UnaryOp;

namespace {

// Unary op; saves x, and y when its derivative is cheaper from the output.
Tensor unary_op(UnaryOp op, const Tensor& x) {
  TS_PROFILE(ops::unary_name(op));
  Tensor y = ops::unary(op, x);
  if (should_record({x})) {
    bool keep_y = op == UnaryOp::Exp || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt ||
                  op == UnaryOp::Tanh || op == UnaryOp::Sigmoid || op == UnaryOp::Reciprocal;
    Tensor saved_y = keep_y ? autograd::detach(y) : Tensor();
    record(ops::unary_name(op), {x}, {y}, [op, x, saved_y](const TensorList& g) {
      return TensorList{ops::unary_backward(op, g[0], x, saved_y)};
    });
  }
  return y;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  TS_PROFILE("add");
  Tensor y = ops::add(a, b);
  if (should_record({a, b})) {
    Shape sa = a.shape(), sb = b.shape();
    record("add", {a, b}, {y}, [sa, sb](const TensorList& g) {
      return TensorList{ops::sum_to(g[0], sa), ops::sum_to(g[0], sb)};
    });
  }
  return y;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  TS_PROFILE("sub");
  Tensor y = ops::sub(a, b);
  if (should_record({a, b})) {
    Shape sa = a.shape(), sb = b.shape();
    record("sub", {a, b}, {y}, [sa, sb](const TensorList& g) {
      return TensorList{ops::sum_to(g[0], sa), ops::sum_to(ops::neg(g[0]), sb)};
    });
  }
  return y;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  TS_PROFILE("mul");
  Tensor y = ops::mul(a, b);
  if (should_record({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    record("mul", {a, b}, {y}, [a, b, ga, gb](const TensorList& g) {
      return TensorList{ga ? ops::sum_to(ops::mul(g[0], b), a.shape()) : Tensor(),
                        gb ? ops::sum_to(ops::mul(g[0], a), b.shape()) : Tensor()};
    });
  }
  return y;
}

Tensor div(const Tensor& a, const Tensor& b) {
  TS_PROFILE("div");
  Tensor y = ops::div(a, b);
  if (should_record({a, b})) {
    bool gb = b.requires_grad();
    record("div", {a, b}, {y}, [a, b, gb](const TensorList& g) {
      Tensor ga = ops::sum_to(ops::div(g[0], b), a.shape());
      Tensor gbv;
      if (gb) gbv = ops::sum_to(ops::neg(ops::div(ops::mul(g[0], a), ops::mul(b, b))), b.shape());
      return TensorList{ga, gbv};
    });
  }
  return y;
}

Tensor add(const Tensor& a, double b) {
  TS_PROFILE("add");
  Tensor y = ops::add(a, b);
  if (should_record({a})) record("add_scalar", {a}, {y}, [](const TensorList& g) { return g; });
  return y;
}

Tensor mul(const Tensor& a, double b) {
  TS_PROFILE("mul");
  Tensor y = ops::mul(a, b);
  if (should_record({a}))
    record("mul_scalar", {a}, {y}, [b](const TensorList& g) { return TensorList{ops::mul(g[0], b)}; });
  return y;
}

Tensor pow(const Tensor& a, double e) {
  TS_PROFILE("pow");
  Tensor y = ops::binary(BinaryOp::Pow, a, e);
  if (should_record({a})) {
    record("pow", {a}, {y}, [a, e](const TensorList& g) {
      Tensor d = ops::mul(ops::binary(BinaryOp::Pow, a, e - 1.0), e);
      return TensorList{ops::mul(g[0], d)};
    });
  }
  return y;
}

Tensor pow(const Tensor& a, const Tensor& e) {
  TS_PROFILE("pow");
  Tensor y = ops::binary(BinaryOp::Pow, a, e);
  if (should_record({a, e})) {
    Tensor saved_y = autograd::detach(y);
    bool ge = e.requires_grad();
    record("pow", {a, e}, {y}, [a, e, saved_y, ge](const TensorList& g) {
      Tensor da = ops::mul(e, ops::binary(BinaryOp::Pow, a, ops::sub(e, ones({}, e.dtype(), e.device()))));
      Tensor de;
      if (ge) de = ops::sum_to(ops::mul(g[0], ops::mul(saved_y, ops::unary(UnaryOp::Log, a))), e.shape());
      return TensorList{ops::sum_to(ops::mul(g[0], da), a.shape()), de};
    });
  }
  return y;
}

namespace {
// maximum/minimum: the gradient goes to the selected input; ties split it evenly.
Tensor extremum(BinaryOp op, const Tensor& a, const Tensor& b) {
  TS_PROFILE(ops::binary_name(op));
  Tensor y = ops::binary(op, a, b);
  if (should_record({a, b})) {
    record(ops::binary_name(op), {a, b}, {y}, [op, a, b](const TensorList& g) {
      BinaryOp wins = op == BinaryOp::Maximum ? BinaryOp::Gt : BinaryOp::Lt;
      Tensor half = ops::mul(g[0], 0.5);
      Tensor zero = zeros({}, g[0].dtype(), g[0].device());
      Tensor tie = ops::binary(BinaryOp::Eq, a, b);
      Tensor ga = ops::where(ops::binary(wins, a, b), g[0], ops::where(tie, half, zero));
      Tensor gb = ops::where(ops::binary(wins, b, a), g[0], ops::where(tie, half, zero));
      return TensorList{ops::sum_to(ga, a.shape()), ops::sum_to(gb, b.shape())};
    });
  }
  return y;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::Maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::Minimum, a, b); }

Tensor neg(const Tensor& x) { return unary_op(UnaryOp::Neg, x); }
Tensor exp(const Tensor& x) { return unary_op(UnaryOp::Exp, x); }
Tensor log(const Tensor& x) { return unary_op(UnaryOp::Log, x); }
Tensor sqrt(const Tensor& x) { return unary_op(UnaryOp::Sqrt, x); }
Tensor rsqrt(const Tensor& x) { return unary_op(UnaryOp::Rsqrt, x); }
Tensor abs(const Tensor& x) { return unary_op(UnaryOp::Abs, x); }
Tensor tanh(const Tensor& x) { return unary_op(UnaryOp::Tanh, x); }
Tensor sigmoid(const Tensor& x) { return unary_op(UnaryOp::Sigmoid, x); }
Tensor relu(const Tensor& x) { return unary_op(UnaryOp::Relu, x); }
Tensor gelu(const Tensor& x, bool tanh_approximation) {
  TS_PROFILE("gelu");
  return unary_op(tanh_approximation ? UnaryOp::GeluTanh : UnaryOp::Gelu, x);
}
Tensor silu(const Tensor& x) { return unary_op(UnaryOp::Silu, x); }
Tensor sin(const Tensor& x) { return unary_op(UnaryOp::Sin, x); }
Tensor cos(const Tensor& x) { return unary_op(UnaryOp::Cos, x); }
Tensor square(const Tensor& x) { return unary_op(UnaryOp::Square, x); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  TS_PROFILE("where");
  Tensor y = ops::where(cond, a, b);
  if (should_record({a, b})) {
    record("where", {a, b}, {y}, [cond, a, b](const TensorList& g) {
      Tensor zero = zeros({}, g[0].dtype(), g[0].device());
      return TensorList{ops::sum_to(ops::where(cond, g[0], zero), a.shape()),
                        ops::sum_to(ops::where(cond, zero, g[0]), b.shape())};
    });
  }
  return y;
}

Tensor eq(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Ge, a, b); }

// ---- reductions ----------------------------------------------------------------------

namespace {
// Shape of x with the reduced dims kept as size 1 (for broadcasting a gradient back).
Shape keepdim_shape(const Tensor& x, const std::vector<int64_t>& dims) {
  Shape s = x.shape();
  if (dims.empty()) return Shape(s.size(), 1);
  for (int64_t d : dims) s[wrap_dim(d, x.dim(), "sum")] = 1;
  return s;
}
int64_t reduced_count(const Tensor& x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x.numel();
  int64_t n = 1;
  for (int64_t d : dims) n *= x.shape()[wrap_dim(d, x.dim(), "sum")];
  return n;
}
}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  TS_PROFILE("sum");
  Tensor y = ops::sum(x, dims, keepdim);
  if (should_record({x})) {
    Shape kept = keepdim_shape(x, dims), full_shape = x.shape();
    record("sum", {x}, {y}, [kept, full_shape](const TensorList& g) {
      return TensorList{ops::expand(ops::reshape(g[0], kept), full_shape)};
    });
  }
  return y;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  TS_PROFILE("mean");
  Tensor y = ops::mean(x, dims, keepdim);
  if (should_record({x})) {
    Shape kept = keepdim_shape(x, dims), full_shape = x.shape();
    double scale = 1.0 / static_cast<double>(reduced_count(x, dims));
    record("mean", {x}, {y}, [kept, full_shape, scale](const TensorList& g) {
      return TensorList{ops::expand(ops::reshape(ops::mul(g[0], scale), kept), full_shape)};
    });
  }
  return y;
}

Tensor var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim) {
  TS_PROFILE("var");
  Tensor y = ops::var(x, dims, correction, keepdim);
  if (should_record({x})) {
    Shape kept = keepdim_shape(x, dims);
    int64_t n = reduced_count(x, dims);
    record("var", {x}, {y}, [x, dims, kept, n, correction](const TensorList& g) {
      Tensor centered = ops::sub(x, ops::mean(x, dims, true));
      double scale = 2.0 / static_cast<double>(std::max<int64_t>(n - correction, 0));
      return TensorList{ops::mul(ops::mul(centered, ops::reshape(g[0], kept)), scale)};
    });
  }
  return y;
}

std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) {
  TS_PROFILE("max");
  auto [values, indices] = ops::max(x, dim, keepdim);
  if (should_record({x})) {
    int64_t d = wrap_dim(dim, x.dim(), "max");
    Tensor idx = keepdim ? indices : ops::unsqueeze(indices, d);
    Shape full_shape = x.shape();
    record("max", {x}, {values}, [idx, d, keepdim, full_shape](const TensorList& g) {
      Shape iota_shape(full_shape.size(), 1);
      iota_shape[d] = full_shape[d];
      Tensor iota = ops::reshape(arange(0, full_shape[d], 1, DType::I64, idx.device()), iota_shape);
      Tensor hit = ops::binary(BinaryOp::Eq, iota, idx);
      Tensor gk = keepdim ? g[0] : ops::unsqueeze(g[0], d);
      return TensorList{ops::where(hit, gk, zeros({}, g[0].dtype(), g[0].device()))};
    });
  }
  return {values, indices};
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) { return ops::argmax(x, dim, keepdim); }

}  // namespace tessera
