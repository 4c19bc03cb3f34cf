// Differentiable views, copies and concatenation.
#include <numeric>

#include "autograd/functions.h"
#include "runtime/profiler.h"

namespace tessera {

using autograd::record;
using autograd::should_record;

namespace {
// Records a single-input, single-output op whose backward maps grad -> input grad.
template <class F>
Tensor unary_node(const char* name, const Tensor& x, Tensor y, F&& grad_fn) {
  if (should_record({x})) {
    record(name, {x}, {y}, [grad_fn = std::forward<F>(grad_fn)](const TensorList& g) {
      return TensorList{grad_fn(g[0])};
    });
  }
  return y;
}

// The gradient of a view into x: zeros of x's shape with g written into the view.
template <class ViewFn>
Tensor scatter_into_zeros(const Shape& shape, DType dtype, Device device, const Tensor& g,
                          ViewFn&& view_of) {
  Tensor out = zeros(shape, dtype, device);
  Tensor region = view_of(out);
  ops::copy_(region, g);
  return out;
}
}  // namespace

Tensor reshape(const Tensor& x, const Shape& shape) {
  TS_PROFILE("reshape");
  Shape in = x.shape();
  return unary_node("reshape", x, ops::reshape(x, shape),
                    [in](const Tensor& g) { return ops::reshape(g, in); });
}

Tensor view(const Tensor& x, const Shape& shape) {
  TS_PROFILE("view");
  Shape in = x.shape();
  return unary_node("view", x, ops::view(x, shape),
                    [in](const Tensor& g) { return ops::reshape(g, in); });
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  TS_PROFILE("permute");
  Tensor y = ops::permute(x, dims);
  std::vector<int64_t> inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inverse[wrap_dim(dims[i], x.dim(), "permute")] = static_cast<int64_t>(i);
  return unary_node("permute", x, y, [inverse](const Tensor& g) { return ops::permute(g, inverse); });
}

Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1) {
  TS_PROFILE("transpose");
  return unary_node("transpose", x, ops::transpose(x, dim0, dim1),
                    [dim0, dim1](const Tensor& g) { return ops::transpose(g, dim0, dim1); });
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  TS_PROFILE("narrow");
  Tensor y = ops::narrow(x, dim, start, length);
  Shape s = x.shape();
  DType dt = x.dtype();
  Device dev = x.device();
  return unary_node("narrow", x, y, [=](const Tensor& g) {
    return scatter_into_zeros(s, dt, dev, g,
                              [&](const Tensor& z) { return ops::narrow(z, dim, start, length); });
  });
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  TS_PROFILE("slice");
  Tensor y = ops::slice(x, dim, start, end, step);
  Shape s = x.shape();
  DType dt = x.dtype();
  Device dev = x.device();
  return unary_node("slice", x, y, [=](const Tensor& g) {
    return scatter_into_zeros(s, dt, dev, g,
                              [&](const Tensor& z) { return ops::slice(z, dim, start, end, step); });
  });
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  TS_PROFILE("select");
  Tensor y = ops::select(x, dim, index);
  Shape s = x.shape();
  DType dt = x.dtype();
  Device dev = x.device();
  return unary_node("select", x, y, [=](const Tensor& g) {
    return scatter_into_zeros(s, dt, dev, g,
                              [&](const Tensor& z) { return ops::select(z, dim, index); });
  });
}

Tensor expand(const Tensor& x, const Shape& shape) {
  TS_PROFILE("expand");
  Shape in = x.shape();
  return unary_node("expand", x, ops::expand(x, shape),
                    [in](const Tensor& g) { return ops::sum_to(g, in); });
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  TS_PROFILE("squeeze");
  Shape in = x.shape();
  return unary_node("squeeze", x, ops::squeeze(x, dim),
                    [in](const Tensor& g) { return ops::reshape(g, in); });
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  TS_PROFILE("unsqueeze");
  Shape in = x.shape();
  return unary_node("unsqueeze", x, ops::unsqueeze(x, dim),
                    [in](const Tensor& g) { return ops::reshape(g, in); });
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  TS_PROFILE("flatten");
  Shape in = x.shape();
  return unary_node("flatten", x, ops::flatten(x, start_dim, end_dim),
                    [in](const Tensor& g) { return ops::reshape(g, in); });
}

Tensor contiguous(const Tensor& x) {
  TS_PROFILE("contiguous");
  if (x.is_contiguous()) return x;
  return unary_node("contiguous", x, ops::contiguous(x), [](const Tensor& g) { return g; });
}

Tensor clone(const Tensor& x) {
  TS_PROFILE("clone");
  return unary_node("clone", x, ops::clone(x), [](const Tensor& g) { return g; });
}

Tensor to(const Tensor& x, DType dtype) {
  TS_PROFILE("to");
  if (x.dtype() == dtype) return x;
  DType in = x.dtype();
  TS_CHECK(!x.requires_grad() || is_floating(dtype),
           "to: cannot convert a tensor that requires grad to {} (gradients need a float dtype)",
           dtype_name(dtype));
  return unary_node("to", x, ops::to(x, dtype), [in](const Tensor& g) { return ops::to(g, in); });
}

namespace {
std::vector<Tensor> record_split(const char* name, const Tensor& x, std::vector<Tensor> parts,
                                 int64_t dim) {
  if (!should_record({x})) return parts;
  dim = wrap_dim(dim, x.dim(), name);
  record(name, {x}, parts, [dim](const TensorList& g) { return TensorList{ops::cat(g, dim)}; });
  return parts;
}
}  // namespace

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  TS_PROFILE("split");
  return record_split("split", x, ops::split(x, split_size, dim), dim);
}

std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes,
                                     int64_t dim) {
  TS_PROFILE("split_with_sizes");
  return record_split("split_with_sizes", x, ops::split_with_sizes(x, sizes, dim), dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  TS_PROFILE("chunk");
  return record_split("chunk", x, ops::chunk(x, chunks, dim), dim);
}

Tensor cat(const TensorList& xs, int64_t dim) {
  TS_PROFILE("cat");
  Tensor y = ops::cat(xs, dim);
  if (should_record(xs)) {
    int64_t d = wrap_dim(dim, xs[0].dim(), "cat");
    std::vector<int64_t> sizes;
    for (const Tensor& x : xs) sizes.push_back(x.shape()[d]);
    record("cat", xs, {y}, [d, sizes](const TensorList& g) {
      return TensorList(ops::split_with_sizes(g[0], sizes, d));
    });
  }
  return y;
}

Tensor stack(const TensorList& xs, int64_t dim) {
  TS_PROFILE("stack");
  TS_CHECK(!xs.empty(), "stack: expected at least one tensor");
  TensorList parts;
  for (const Tensor& x : xs) parts.push_back(unsqueeze(x, wrap_dim(dim, xs[0].dim() + 1, "stack")));
  return cat(parts, dim);
}

// ---- in-place ----------------------------------------------------------------------

namespace {
void check_inplace(const Tensor& x, const char* op) {
  TS_CHECK(!(autograd::is_grad_enabled() && x.requires_grad()),
           "{}: in-place update of a tensor that requires grad; do it under "
           "autograd::NoGradGuard (as optimizers do) or on a detached tensor",
           op);
}
}  // namespace

const Tensor& copy_(const Tensor& dst, const Tensor& src) {
  TS_PROFILE("copy_");
  check_inplace(dst, "copy_");
  return ops::copy_(dst, src);
}

const Tensor& fill_(const Tensor& x, double value) {
  TS_PROFILE("fill_");
  check_inplace(x, "fill_");
  return ops::fill_(x, value);
}

const Tensor& zero_(const Tensor& x) {
  TS_PROFILE("zero_");
  check_inplace(x, "zero_");
  return ops::zero_(x);
}

}  // namespace tessera
