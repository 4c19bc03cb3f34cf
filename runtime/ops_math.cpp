// Elementwise math, in-place updates and reductions.
#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/op_call.h"
#include "runtime/kernels.h"
#include "runtime/ops.h"
#include "runtime/stream.h"

namespace tessera::ops {

const char* unary_name(UnaryOp op) {
  static const char* names[] = {"neg",  "exp",     "log",  "sqrt",      "rsqrt", "abs",
                                "tanh", "sigmoid", "relu", "gelu",      "gelu_tanh", "silu",
                                "sin",  "cos",     "square", "reciprocal", "sign"};
  return names[static_cast<int>(op)];
}

const char* binary_name(BinaryOp op) {
  static const char* names[] = {"add",     "sub", "mul", "div", "pow", "maximum", "minimum",
                                "eq",      "ne",  "lt",  "le",  "gt",  "ge"};
  return names[static_cast<int>(op)];
}


DType compute_dtype(Device device, KernelFamily family, DType dtype) {
  if (!is_floating(dtype)) return dtype;
  return kernels(device).compute_dtype(family, dtype);
}

namespace {

// Hands an op on subclass tensors to their layer (runtime/op_call.h).
TensorList route(OpId op, const char* name, TensorList inputs, std::function<TensorList(const TensorList&)> local,
                 OpAttrs attrs = {}) {
  return intercept({op, name, std::move(inputs), std::move(attrs), std::move(local)});
}

bool is_comparison(BinaryOp op) { return op >= BinaryOp::Eq; }

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  TS_CHECK(a.device() == b.device(), "{}: tensors are on different devices ({} and {})", op,
           a.device().str(), b.device().str());
}

void check_floating(const Tensor& x, const char* op) {
  TS_CHECK(is_floating(x.dtype()), "{}: expected a floating-point tensor, got {}", op,
           dtype_name(x.dtype()));
}

// x converted to the dtype `family`'s kernels compute in (bf16/f16 -> f32 on the CPU).
Tensor upcast(const Tensor& x, KernelFamily family) {
  return to(x, compute_dtype(x.device(), family, x.dtype()));
}
constexpr KernelFamily kElementwise = KernelFamily::Elementwise;
constexpr KernelFamily kReduction = KernelFamily::Reduction;

// Runs an in-place update `f(target)` on x; a dtype the elementwise kernels do
// not take natively goes through a copy in their compute dtype.
template <class F>
const Tensor& update_inplace(const Tensor& x, const char* op, F&& f) {
  check_floating(x, op);
  const DType cd = compute_dtype(x.device(), kElementwise, x.dtype());
  if (cd == x.dtype()) {
    f(x);
    return x;
  }
  Tensor tmp = to(x, cd);
  f(tmp);
  dispatch(x.device()).copy(x, tmp);
  return x;
}

}  // namespace

Tensor unary(UnaryOp op, const Tensor& x) {
  if (x.is_subclass())
    return route(OpId::unary, unary_name(op), {x}, [op](const TensorList& l) { return TensorList{unary(op, l[0])}; },
                 {.linear = op == UnaryOp::Neg})[0];
  check_floating(x, unary_name(op));
  Tensor xc = upcast(x, kElementwise);
  Tensor out = empty(x.shape(), xc.dtype(), x.device());
  dispatch(x.device()).unary(op, out, xc);
  return to(out, x.dtype());
}

Tensor unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y) {
  if (intercepts({&grad, &x, &y}))
    return route(OpId::unary_backward, "unary_backward", {grad, x, y}, [op](const TensorList& l) {
      return TensorList{unary_backward(op, l[0], l[1], l[2])};
    })[0];
  TS_CHECK(grad.shape() == x.shape(), "{}_backward: grad shape {} vs input shape {}",
           unary_name(op), shape_str(grad.shape()), shape_str(x.shape()));
  Tensor gx = empty(x.shape(), compute_dtype(x.device(), kElementwise, x.dtype()), x.device());
  {
    Tensor gc = upcast(grad, kElementwise), xc = upcast(x, kElementwise);
    Tensor yc = y.defined() ? upcast(y, kElementwise) : Tensor();
    dispatch(x.device()).unary_backward(op, gx, gc, xc, yc);
  }
  return to(gx, x.dtype());
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  if (intercepts({&a, &b})) {
    // Linear in both operands: add and sub; mul and div by a plain scalar.
    const bool by_scalar = !b.is_subclass() && b.dim() == 0;
    const bool linear = op == BinaryOp::Add || op == BinaryOp::Sub ||
                        ((op == BinaryOp::Mul || op == BinaryOp::Div) && by_scalar);
    return route(OpId::binary, name, {a, b}, [op](const TensorList& l) { return TensorList{binary(op, l[0], l[1])}; },
                 {.linear = linear})[0];
  }
  TS_CHECK(a.dtype() == b.dtype(), "{}: dtype mismatch ({} and {}); convert one with to()", name,
           dtype_name(a.dtype()), dtype_name(b.dtype()));
  check_same_device(a, b, name);
  TS_CHECK(op != BinaryOp::Div || is_floating(a.dtype()),
           "div: integer division is not supported ({}); convert to a floating dtype",
           dtype_name(a.dtype()));
  TS_CHECK(a.dtype() != DType::Bool || is_comparison(op) || op == BinaryOp::Maximum ||
               op == BinaryOp::Minimum,
           "{}: not supported on bool tensors", name);
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  DType out_dtype = is_comparison(op) ? DType::Bool : a.dtype();
  Tensor ac = upcast(a, kElementwise), bc = upcast(b, kElementwise);
  Tensor out = empty(shape, is_comparison(op) ? DType::Bool : ac.dtype(), a.device());
  dispatch(a.device()).binary(op, out, expand(ac, shape), expand(bc, shape));
  return to(out, out_dtype);
}

Tensor binary(BinaryOp op, const Tensor& a, double b) {
  TS_CHECK(is_floating(a.dtype()) || b == std::floor(b),
           "{}: non-integer scalar {} with an integer tensor ({})", binary_name(op), b,
           dtype_name(a.dtype()));
  return binary(op, a, full({}, b, a.dtype(), a.device()));
}

Tensor binary(BinaryOp op, double a, const Tensor& b) {
  TS_CHECK(is_floating(b.dtype()) || a == std::floor(a),
           "{}: non-integer scalar {} with an integer tensor ({})", binary_name(op), a,
           dtype_name(b.dtype()));
  return binary(op, full({}, a, b.dtype(), b.device()), b);
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (intercepts({&cond, &a, &b}))
    return route(OpId::where, "where", {cond, a, b},
                 [](const TensorList& l) { return TensorList{where(l[0], l[1], l[2])}; })[0];
  TS_CHECK(cond.dtype() == DType::Bool, "where: condition must be bool, got {}",
           dtype_name(cond.dtype()));
  TS_CHECK(a.dtype() == b.dtype(), "where: dtype mismatch ({} and {})", dtype_name(a.dtype()),
           dtype_name(b.dtype()));
  check_same_device(a, b, "where");
  check_same_device(cond, a, "where");
  Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(),
                                 "where");
  Tensor out = empty(shape, a.dtype(), a.device());
  dispatch(a.device()).where(out, expand(cond, shape), expand(a, shape), expand(b, shape));
  return out;
}

// ---- in-place ---------------------------------------------------------------

const Tensor& copy_(const Tensor& dst, const Tensor& src, bool non_blocking) {
  if (intercepts({&dst, &src})) {
    route(OpId::copy_, "copy_", {dst, src}, [non_blocking](const TensorList& l) {
      return TensorList{copy_(l[0], l[1], non_blocking)};
    });
    return dst;
  }
  if (dst.is_meta() && !src.is_meta()) return dst;  // values into a tensor without bytes: nothing to copy
  TS_CHECK(!src.is_meta() || dst.is_meta(), "copy_: cannot copy from a meta tensor (it has no data) into {}",
           dst.device().str());
  Tensor s = expand(src, dst.shape());
  const Device to = dst.device(), from = src.device();
  if (to == from) {
    dispatch(to).copy(dst, s);
  } else if (from.is_host_visible()) {  // host -> device, queued on the device's stream
    dispatch(to).copy_from_host(dst, s);
  } else if (to.is_host_visible()) {  // device -> host: the host reads dst next, so wait
    dispatch(from).copy_to_host(dst, s);
    if (!non_blocking) current_stream(from).synchronize();
  } else {  // device -> device: through the host
    Tensor staged = empty(dst.shape(), src.dtype(), Device::cpu());
    copy_(staged, s, false);
    dispatch(to).copy_from_host(dst, staged);
  }
  return dst;
}

const Tensor& fill_(const Tensor& x, double value) {
  if (x.is_subclass()) {
    route(OpId::fill_, "fill_", {x}, [value](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{fill_(t, value)};
    });
    return x;
  }
  dispatch(x.device()).fill(x, value);
  return x;
}

const Tensor& zero_(const Tensor& x) { return fill_(x, 0.0); }

namespace {
Tensor operand(const Tensor& x, const Tensor& other, const char* op) {
  TS_CHECK(other.dtype() == x.dtype(), "{}: dtype mismatch ({} into {})", op,
           dtype_name(other.dtype()), dtype_name(x.dtype()));
  check_same_device(x, other, op);
  Shape b = broadcast_shapes(x.shape(), other.shape(), op);
  TS_CHECK(b == x.shape(), "{}: operand shape {} does not broadcast to the target's shape {}", op,
           shape_str(other.shape()), shape_str(x.shape()));
  return expand(upcast(other, kElementwise), x.shape());
}

// x op= value, the scalar kept in the compute dtype (f32 for a bf16 x: rounded
// to bf16 first, 0.99 would become 0.990234375).
const Tensor& update_with_scalar(const Tensor& x, OpId id, BinaryOp op, const char* name, double value) {
  if (x.is_subclass()) {
    route(id, name, {x}, [id, op, name, value](const TensorList& l) {
      return TensorList{update_with_scalar(l[0], id, op, name, value)};
    });
    return x;
  }
  return update_inplace(x, name, [&](const Tensor& t) {
    dispatch(t.device()).binary_scalar(op, t, t, value, false);
  });
}
}  // namespace

const Tensor& add_(const Tensor& x, const Tensor& other, double alpha) {
  if (intercepts({&x, &other})) {
    route(OpId::add_, "add_", {x, other}, [alpha](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{add_(t, l[1], alpha)};
    });
    return x;
  }
  Tensor o = operand(x, other, "add_");
  return update_inplace(x, "add_", [&](const Tensor& t) {
    dispatch(t.device()).pointwise(PointwiseOp::AddScaled, t, o, Tensor(), alpha);
  });
}

const Tensor& add_(const Tensor& x, double value) { return update_with_scalar(x, OpId::add_, BinaryOp::Add, "add_", value); }

const Tensor& mul_(const Tensor& x, const Tensor& other) {
  if (intercepts({&x, &other})) {
    route(OpId::mul_, "mul_", {x, other}, [](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{mul_(t, l[1])};
    });
    return x;
  }
  Tensor o = operand(x, other, "mul_");
  return update_inplace(x, "mul_", [&](const Tensor& t) {
    dispatch(t.device()).binary(BinaryOp::Mul, t, t, o);
  });
}

const Tensor& mul_(const Tensor& x, double value) { return update_with_scalar(x, OpId::mul_, BinaryOp::Mul, "mul_", value); }

const Tensor& div_(const Tensor& x, const Tensor& other) {
  if (intercepts({&x, &other})) {
    route(OpId::div_, "div_", {x, other}, [](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{div_(t, l[1])};
    });
    return x;
  }
  Tensor o = operand(x, other, "div_");
  return update_inplace(x, "div_", [&](const Tensor& t) {
    dispatch(t.device()).binary(BinaryOp::Div, t, t, o);
  });
}

const Tensor& addcmul_(const Tensor& x, const Tensor& a, const Tensor& b, double value) {
  if (intercepts({&x, &a, &b})) {
    route(OpId::addcmul_, "addcmul_", {x, a, b}, [value](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{addcmul_(t, l[1], l[2], value)};
    });
    return x;
  }
  Tensor oa = operand(x, a, "addcmul_"), ob = operand(x, b, "addcmul_");
  return update_inplace(x, "addcmul_", [&](const Tensor& t) {
    dispatch(t.device()).pointwise(PointwiseOp::Addcmul, t, oa, ob, value);
  });
}

const Tensor& addcdiv_(const Tensor& x, const Tensor& a, const Tensor& b, double value) {
  if (intercepts({&x, &a, &b})) {
    route(OpId::addcdiv_, "addcdiv_", {x, a, b}, [value](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{addcdiv_(t, l[1], l[2], value)};
    });
    return x;
  }
  Tensor oa = operand(x, a, "addcdiv_"), ob = operand(x, b, "addcdiv_");
  return update_inplace(x, "addcdiv_", [&](const Tensor& t) {
    dispatch(t.device()).pointwise(PointwiseOp::Addcdiv, t, oa, ob, value);
  });
}

const Tensor& lerp_(const Tensor& x, const Tensor& end, double weight) {
  if (intercepts({&x, &end})) {
    route(OpId::lerp_, "lerp_", {x, end}, [weight](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{lerp_(t, l[1], weight)};
    });
    return x;
  }
  Tensor o = operand(x, end, "lerp_");
  return update_inplace(x, "lerp_", [&](const Tensor& t) {
    dispatch(t.device()).pointwise(PointwiseOp::Lerp, t, o, Tensor(), weight);
  });
}

const Tensor& sqrt_(const Tensor& x) {
  if (intercepts({&x})) {
    route(OpId::sqrt_, "sqrt_", {x}, [](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{sqrt_(t)};
    });
    return x;
  }
  return update_inplace(x, "sqrt_", [&](const Tensor& t) {
    dispatch(t.device()).unary(UnaryOp::Sqrt, t, t);
  });
}

const Tensor& clamp_(const Tensor& x, std::optional<double> min, std::optional<double> max) {
  if (intercepts({&x})) {
    route(OpId::clamp_, "clamp_", {x}, [min, max](const TensorList& l) {
      Tensor t = l[0];
      return TensorList{clamp_(t, min, max)};
    });
    return x;
  }
  double lo = min.value_or(-std::numeric_limits<double>::infinity());
  double hi = max.value_or(std::numeric_limits<double>::infinity());
  return update_inplace(x, "clamp_", [&](const Tensor& t) { dispatch(t.device()).clamp(t, lo, hi); });
}

bool adamw_fusable(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v) {
  for (const Tensor* t : {&p, &g, &m, &v})
    if (!t->defined() || t->is_subclass() || !t->is_contiguous() ||
        t->dtype() != p.dtype() || t->device() != p.device() || t->shape() != p.shape())
      return false;
  return is_floating(p.dtype());
}

void adamw_(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
            const AdamWStep& step) {
  size_t n = params.size();
  TS_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
           "adamw_: expected as many gradients and moments as parameters ({}), got {}, {} and {}", n,
           grads.size(), exp_avgs.size(), exp_avg_sqs.size());
  TS_CHECK(step.step >= 1, "adamw_: expected a step count >= 1, got {}", step.step);
  if (n == 0) return;
  for (size_t i = 0; i < n; ++i) {
    TS_CHECK(adamw_fusable(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]),
             "adamw_: parameter {} ({} {} on {}) and its gradient and moments must be local, "
             "contiguous tensors of one shape, device and float dtype",
             i, shape_str(params[i].shape()), dtype_name(params[i].dtype()), params[i].device().str());
    TS_CHECK(params[i].device() == params[0].device(),
             "adamw_: parameters on different devices ({} and {})", params[0].device().str(),
             params[i].device().str());
  }
  // The kernel updates parameters and moments concurrently: no two may share memory.
  std::vector<std::pair<const char*, const char*>> spans;
  for (const auto* list : {&params, &exp_avgs, &exp_avg_sqs})
    for (const Tensor& t : *list) {
      if (t.numel() == 0 || t.is_meta()) continue;  // meta: no bytes to share
      const char* b = static_cast<const char*>(t.data_ptr());
      spans.emplace_back(b, b + t.numel() * static_cast<int64_t>(dtype_size(t.dtype())));
    }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TS_CHECK(spans[i].first >= spans[i - 1].second || spans[i - 1].first == spans[i - 1].second,
             "adamw_: two of the parameters or moments share memory (a parameter listed twice?)");
  dispatch(params[0].device()).adamw(params, grads, exp_avgs, exp_avg_sqs, step);
}

void scale_(const std::vector<Tensor>& xs, const Tensor& coef) {
  TS_CHECK(coef.defined() && coef.dim() == 0 && is_floating(coef.dtype()) && !coef.is_subclass(),
           "scale_: the coefficient must be a 0-dim float tensor, got {} {}",
           coef.defined() ? shape_str(coef.shape()) : "an undefined tensor",
           coef.defined() ? dtype_name(coef.dtype()) : "");
  std::vector<Tensor> live;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    TS_CHECK(x.defined() && !x.is_subclass() && x.is_contiguous() && is_floating(x.dtype()),
             "scale_: tensor {} must be a local, contiguous float tensor, got {} {}", i,
             x.defined() ? shape_str(x.shape()) : "an undefined tensor", x.defined() ? dtype_name(x.dtype()) : "");
    TS_CHECK(x.device() == coef.device(), "scale_: tensor {} is on {} but the coefficient on {}", i,
             x.device().str(), coef.device().str());
    if (x.numel() > 0) live.push_back(x);
  }
  if (live.empty()) return;
  dispatch(coef.device()).scale(live, coef.dtype() == DType::F64 ? coef : to(coef, DType::F64));
}

// ---- reductions ---------------------------------------------------------------

namespace {

// Sorted, unique, wrapped dims; empty input means all dims.
std::vector<int64_t> reduce_dims(const Tensor& x, const std::vector<int64_t>& dims, const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t d = 0; d < x.dim(); ++d) out.push_back(d);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, x.dim(), op));
  std::sort(out.begin(), out.end());
  TS_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), "{}: repeated dim", op);
  return out;
}

Shape reduced_shape(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  for (int64_t d = 0; d < x.dim(); ++d) {
    bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!reduced) out.push_back(x.shape()[d]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

// Reduces x over `dims` (sorted) into a tensor of the kept dims (keepdim
// layout) of dtype `into`: x's, or f32 for 16-bit x on a table whose reduce
// widens (runtime/kernels.h).
Tensor reduce_impl(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, DType into) {
  Shape kept = reduced_shape(x, dims, true);
  Tensor out = empty(kept, into, x.device());
  if (x.numel() == 0) {
    TS_CHECK(op == ReduceOp::Sum, "max/min: cannot reduce an empty tensor");
    return fill_(out, 0.0);
  }
  bool consecutive = dims.empty() || dims.back() - dims.front() + 1 == static_cast<int64_t>(dims.size());
  Tensor src = x;
  int64_t outer = 1, n = 1, inner = 1;
  if (consecutive && x.is_contiguous()) {
    int64_t lo = dims.empty() ? 0 : dims.front(), hi = dims.empty() ? -1 : dims.back();
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (d < lo) outer *= x.shape()[d];
      else if (d <= hi) n *= x.shape()[d];
      else inner *= x.shape()[d];
    }
  } else {
    // Move reduced dims last and copy: [kept..., reduced...].
    std::vector<int64_t> perm;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) perm.push_back(d);
    for (int64_t d : dims) perm.push_back(d);
    src = contiguous(permute(x, perm));
    for (int64_t d : dims) n *= x.shape()[d];
    outer = x.numel() / n;
  }
  dispatch(x.device()).reduce(op, out, contiguous(src), outer, n, inner);
  return out;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims_in, bool keepdim,
           std::optional<DType> out_dtype) {
  if (x.is_subclass())
    return route(OpId::sum, "sum", {x}, [dims_in, keepdim, out_dtype](const TensorList& l) {
      return TensorList{sum(l[0], dims_in, keepdim, out_dtype)};
    }, {.dims = dims_in, .keepdim = keepdim})[0];
  auto dims = reduce_dims(x, dims_in, "sum");
  DType acc =
      is_floating(x.dtype()) ? compute_dtype(x.device(), kReduction, x.dtype()) : DType::I64;
  DType result = out_dtype.value_or(is_floating(x.dtype()) ? x.dtype() : DType::I64);
  Shape shape = reduced_shape(x, dims, keepdim);
  // 16-bit x summed in f32: read where it lies where the kernel widens it.
  const bool widens = acc == DType::F32 && x.dtype() != acc && dispatch(x.device()).table().sums_widen;
  Tensor r = reduce_impl(ReduceOp::Sum, widens ? x : to(x, acc), dims, acc);
  return to(reshape(r, shape), result);
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims_in, bool keepdim) {
  check_floating(x, "mean");
  if (x.is_subclass()) {  // the subclass's sum divided by the logical count
    int64_t n = 1;
    for (int64_t d : reduce_dims(x, dims_in, "mean")) n *= x.shape()[d];
    return mul(sum(x, dims_in, keepdim), 1.0 / static_cast<double>(n));
  }
  auto dims = reduce_dims(x, dims_in, "mean");
  int64_t n = 1;
  for (int64_t d : dims) n *= x.shape()[d];
  Tensor s = sum(x, dims, keepdim, compute_dtype(x.device(), kReduction, x.dtype()));
  return to(mul(s, 1.0 / static_cast<double>(n)), x.dtype());
}

Tensor var(const Tensor& x, const std::vector<int64_t>& dims_in, int64_t correction, bool keepdim) {
  if (x.is_subclass()) return route(OpId::var, "var", {x}, nullptr)[0];
  check_floating(x, "var");
  auto dims = reduce_dims(x, dims_in, "var");
  int64_t n = 1;
  for (int64_t d : dims) n *= x.shape()[d];
  Tensor xc = upcast(x, kReduction);
  Tensor centered = sub(xc, mean(xc, dims, true));
  Tensor ss = sum(mul(centered, centered), dims, keepdim);
  double denom = static_cast<double>(std::max<int64_t>(n - correction, 0));
  return to(mul(ss, 1.0 / denom), x.dtype());
}

std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) {
  if (x.is_subclass()) {
    TensorList r = route(OpId::max, "max", {x}, [dim, keepdim](const TensorList& l) {
      auto [values, indices] = max(l[0], dim, keepdim);
      return TensorList{values, indices};
    });
    return {r[0], r[1]};
  }
  dim = wrap_dim(dim, x.dim(), "max");
  Shape shape = reduced_shape(x, {dim}, keepdim);
  TS_CHECK(x.dim() == 0 || x.shape()[dim] > 0, "max: cannot reduce over dim {} of size 0", dim);
  // Every kernel compares bf16 and f16 as they lie (runtime/op_list.h).
  Tensor moved = x.dim() == 0 ? reshape(x, {1}) : contiguous(transpose(x, dim, -1));
  Shape rows_shape(moved.shape().begin(), moved.shape().end() - 1);
  Tensor values = empty(rows_shape, moved.dtype(), x.device());
  Tensor indices = empty(rows_shape, DType::I64, x.device());
  dispatch(x.device()).argmax_rows(values, indices, moved);
  // The rows are in "dim moved last" order: move it back before reshaping.
  if (x.dim() > 0 && dim != x.dim() - 1) {
    values = contiguous(transpose(unsqueeze(values, -1), dim, -1));
    indices = contiguous(transpose(unsqueeze(indices, -1), dim, -1));
  }
  return {reshape(values, shape), reshape(indices, shape)};
}

Tensor max(const Tensor& x) {
  if (x.is_subclass()) return route(OpId::max, "max", {x}, [](const TensorList& l) { return TensorList{max(l[0])}; })[0];
  TS_CHECK(x.numel() > 0, "max: cannot take the maximum of an empty tensor");
  return max(reshape(x, {-1}), 0, false).first;
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  if (x.is_subclass())
    return route(OpId::argmax, "argmax", {x}, [dim, keepdim](const TensorList& l) {
      return TensorList{argmax(l[0], dim, keepdim)};
    })[0];
  return max(x, dim, keepdim).second;
}

Tensor sum_squares(const std::vector<Tensor>& xs, Device device) {
  std::vector<Tensor> inputs;
  for (const Tensor& x : xs) {
    check_floating(x, "sum_squares");
    if (x.is_subclass()) return route(OpId::sum_squares, "sum_squares", {x}, nullptr)[0];
    TS_CHECK(x.device() == device, "sum_squares: a tensor on {} among tensors on {}", x.device().str(),
             device.str());
    if (x.numel() > 0) inputs.push_back(contiguous(x));  // any floating dtype: the kernel squares in f64
  }
  Tensor out = zeros({}, DType::F64, device);
  if (!inputs.empty()) dispatch(device).sum_squares(out, inputs);
  return out;
}

double sum_squares(const Tensor& x) { return sum_squares(std::vector<Tensor>{x}, x.device()).item(); }

}  // namespace tessera::ops
