// Views (shared storage), copies, concatenation and broadcasting.
#include <algorithm>
#include <numeric>

#include "runtime/op_call.h"
#include "runtime/kernels.h"
#include "runtime/ops.h"

namespace tessera::ops {

namespace {
Tensor view_of(const char* op, const Tensor& x, Shape shape, Shape strides, int64_t offset) {
  if (x.is_subclass()) return intercept_one({OpId::strided_view, op, {x}});  // its layer refuses, or says how
  return make_tensor(x.storage(), std::move(shape), std::move(strides), offset, x.dtype());
}

// Replaces one -1 in `shape` by the size that makes numel match.
Shape infer_shape(Shape shape, int64_t numel, const char* op) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      TS_CHECK(infer < 0, "{}: only one dimension can be -1 in {}", op, shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      TS_CHECK(shape[i] >= 0, "{}: invalid size {} in {}", op, shape[i], shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    TS_CHECK(known > 0 && numel % known == 0, "{}: shape {} is invalid for input of size {}", op,
             shape_str(shape), numel);
    shape[infer] = numel / known;
  }
  TS_CHECK(shape_numel(shape) == numel, "{}: shape {} is invalid for input of size {}", op,
           shape_str(shape), numel);
  return shape;
}

// Strides for viewing a (shape, strides) tensor as new_shape without copying,
// or an empty optional when the memory layout does not allow it.
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape) {
  if (shape_numel(shape) == 0 || shape.empty()) return contiguous_strides(new_shape);
  Shape out(new_shape.size());
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base_stride = strides.empty() ? 1 : strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[d];
    if (d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}
}  // namespace

Tensor as_strided(const Tensor& x, const Shape& shape, const Shape& strides, int64_t offset) {
  TS_CHECK(shape.size() == strides.size(), "as_strided: shape {} and strides {} differ in rank",
           shape_str(shape), shape_str(strides));
  int64_t last = offset;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] > 0) last += (shape[i] - 1) * strides[i];
  int64_t capacity = static_cast<int64_t>(x.storage()->nbytes() / dtype_size(x.dtype()));
  TS_CHECK(offset >= 0 && (shape_numel(shape) == 0 || last < capacity),
           "as_strided: view {} strides {} offset {} exceeds storage of {} elements",
           shape_str(shape), shape_str(strides), offset, capacity);
  return view_of("as_strided", x, shape, strides, offset);
}

Tensor view(const Tensor& x, Shape shape) {
  shape = infer_shape(std::move(shape), x.numel(), "view");
  if (x.is_subclass()) return intercept_one({OpId::view, "view", {x}, {.shape = std::move(shape)}});
  auto strides = view_strides(x.shape(), x.strides(), shape);
  TS_CHECK(strides.has_value(),
           "view: shape {} is not compatible with input shape {} and strides {}; use reshape",
           shape_str(shape), shape_str(x.shape()), shape_str(x.strides()));
  return view_of("view", x, shape, *strides, x.storage_offset());
}

Tensor reshape(const Tensor& x, Shape shape) {
  shape = infer_shape(std::move(shape), x.numel(), "reshape");
  if (x.is_subclass()) return intercept_one({OpId::reshape, "reshape", {x}, {.shape = std::move(shape)}});
  auto strides = view_strides(x.shape(), x.strides(), shape);
  if (strides) return view_of("reshape", x, shape, *strides, x.storage_offset());
  return view(contiguous(x), shape);
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  int64_t nd = x.dim();
  TS_CHECK(static_cast<int64_t>(dims.size()) == nd, "permute: got {} dims for a {}-d tensor",
           dims.size(), nd);
  Shape shape(nd), strides(nd);
  std::vector<bool> seen(nd, false);
  for (int64_t i = 0; i < nd; ++i) {
    int64_t d = wrap_dim(dims[i], nd, "permute");
    TS_CHECK(!seen[d], "permute: dim {} repeated", d);
    seen[d] = true;
    shape[i] = x.shape()[d];
    strides[i] = x.strides()[d];
  }
  if (x.is_subclass()) {
    std::vector<int64_t> perm(dims.size());
    for (int64_t i = 0; i < nd; ++i) perm[i] = wrap_dim(dims[i], nd, "permute");
    return intercept_one({OpId::permute, "permute", {x}, {.dims = perm, .shape = shape}});
  }
  return view_of("permute", x, shape, strides, x.storage_offset());
}

Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1) {
  int64_t nd = x.dim();
  dim0 = wrap_dim(dim0, nd, "transpose");
  dim1 = wrap_dim(dim1, nd, "transpose");
  Shape shape = x.shape(), strides = x.strides();
  if (nd == 0) return alias(x);
  if (x.is_subclass()) {
    std::vector<int64_t> perm(static_cast<size_t>(nd));
    for (int64_t i = 0; i < nd; ++i) perm[i] = i;
    std::swap(perm[dim0], perm[dim1]);
    std::swap(shape[dim0], shape[dim1]);
    return intercept_one({OpId::transpose, "transpose", {x}, {.dims = perm, .shape = shape}});
  }
  std::swap(shape[dim0], shape[dim1]);
  std::swap(strides[dim0], strides[dim1]);
  return view_of("transpose", x, shape, strides, x.storage_offset());
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  dim = wrap_dim(dim, x.dim(), "narrow");
  int64_t n = x.shape()[dim];
  if (start < 0) start += n;
  TS_CHECK(start >= 0 && length >= 0 && start + length <= n,
           "narrow: range [{}, {}) out of bounds for dim {} of size {}", start, start + length, dim,
           n);
  Shape shape = x.shape();
  shape[dim] = length;
  return view_of("narrow", x, shape, x.strides(), x.storage_offset() + start * x.strides()[dim]);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  dim = wrap_dim(dim, x.dim(), "slice");
  TS_CHECK(step > 0, "slice: step must be positive, got {}", step);
  int64_t n = x.shape()[dim];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shape = x.shape(), strides = x.strides();
  shape[dim] = (end - start + step - 1) / step;
  strides[dim] *= step;
  return view_of("slice", x, shape, strides, x.storage_offset() + start * x.strides()[dim]);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  dim = wrap_dim(dim, x.dim(), "select");
  int64_t n = x.shape()[dim];
  TS_CHECK(index >= -n && index < n, "select: index {} out of range for dim {} of size {}", index,
           dim, n);
  if (index < 0) index += n;
  Shape shape = x.shape(), strides = x.strides();
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return view_of("select", x, shape, strides, x.storage_offset() + index * x.strides()[dim]);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  int64_t nd = static_cast<int64_t>(shape.size()), xd = x.dim();
  TS_CHECK(nd >= xd, "expand: cannot expand shape {} to fewer dims {}", shape_str(x.shape()),
           shape_str(shape));
  Shape out(nd), strides(nd);
  for (int64_t i = nd - 1; i >= 0; --i) {
    int64_t j = i - (nd - xd);
    int64_t want = shape[i];
    if (j < 0) {
      TS_CHECK(want >= 0, "expand: size -1 not allowed for a new leading dim in {}",
               shape_str(shape));
      out[i] = want;
      strides[i] = 0;
      continue;
    }
    int64_t have = x.shape()[j];
    if (want == -1) want = have;
    TS_CHECK(have == want || have == 1, "expand: cannot expand shape {} to {} (dim {}: {} vs {})",
             shape_str(x.shape()), shape_str(shape), i, have, want);
    out[i] = want;
    strides[i] = have == want ? x.strides()[j] : 0;
  }
  return view_of("expand", x, out, strides, x.storage_offset());
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "squeeze");
  if (x.dim() == 0 || x.shape()[dim] != 1) return alias(x);
  Shape shape = x.shape(), strides = x.strides();
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return view_of("squeeze", x, shape, strides, x.storage_offset());
}

Tensor squeeze(const Tensor& x) {
  Shape shape, strides;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (x.shape()[i] == 1) continue;
    shape.push_back(x.shape()[i]);
    strides.push_back(x.strides()[i]);
  }
  return view_of("squeeze", x, shape, strides, x.storage_offset());
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim() + 1, "unsqueeze");
  Shape shape = x.shape(), strides = x.strides();
  int64_t stride = dim < x.dim() ? x.strides()[dim] * x.shape()[dim] : 1;
  shape.insert(shape.begin() + dim, 1);
  strides.insert(strides.begin() + dim, stride);
  return view_of("unsqueeze", x, shape, strides, x.storage_offset());
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  if (x.dim() == 0) return reshape(x, {1});
  start_dim = wrap_dim(start_dim, x.dim(), "flatten");
  end_dim = wrap_dim(end_dim, x.dim(), "flatten");
  TS_CHECK(start_dim <= end_dim, "flatten: start_dim {} after end_dim {}", start_dim, end_dim);
  Shape shape(x.shape().begin(), x.shape().begin() + start_dim);
  int64_t n = 1;
  for (int64_t d = start_dim; d <= end_dim; ++d) n *= x.shape()[d];
  shape.push_back(n);
  shape.insert(shape.end(), x.shape().begin() + end_dim + 1, x.shape().end());
  return reshape(x, shape);
}

Tensor alias(const Tensor& x) {
  return view_of("alias", x, x.shape(), x.strides(), x.storage_offset());
}

std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes,
                                     int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "split");
  int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TS_CHECK(total == x.shape()[dim], "split: sizes sum to {} but dim {} has size {}", total, dim,
           x.shape()[dim]);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(x, dim, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "split");
  TS_CHECK(split_size > 0, "split: split_size must be positive, got {}", split_size);
  int64_t n = x.shape()[dim];
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < n; start += split_size) sizes.push_back(std::min(split_size, n - start));
  if (sizes.empty()) sizes.push_back(0);
  return split_with_sizes(x, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  TS_CHECK(chunks > 0, "chunk: number of chunks must be positive, got {}", chunks);
  dim = wrap_dim(dim, x.dim(), "chunk");
  int64_t n = x.shape()[dim];
  return split(x, std::max<int64_t>(1, (n + chunks - 1) / chunks), dim);
}

Tensor contiguous(const Tensor& x) {
  if (x.is_subclass())
    return intercept_one({OpId::contiguous, "contiguous", {x}, {},
                          [](const TensorList& l) { return TensorList{contiguous(l[0])}; }});
  return x.is_contiguous() ? x : clone(x);
}

Tensor clone(const Tensor& x) {
  if (x.is_subclass())
    return intercept_one({OpId::clone, "clone", {x}, {}, [](const TensorList& l) { return TensorList{clone(l[0])}; }});
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  dispatch(x.device()).copy(out, x);
  return out;
}

Tensor to(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  if (x.is_subclass())
    return intercept_one({OpId::to_dtype, "to", {x}, {}, [dtype](const TensorList& l) { return TensorList{to(l[0], dtype)}; }});
  Tensor out = empty(x.shape(), dtype, x.device());
  dispatch(x.device()).copy(out, x);
  return out;
}

Tensor to(const Tensor& x, Device device, bool non_blocking) {
  if (x.device() == device) return x;
  if (x.is_subclass())
    return intercept_one({OpId::to_device, "to", {x}, {}, [device, non_blocking](const TensorList& l) {
                            return TensorList{to(l[0], device, non_blocking)};
                          }});
  TS_CHECK(!x.is_meta(), "to: a meta tensor has no values to copy to {} (use empty() there)", device.str());
  Tensor out = empty(x.shape(), x.dtype(), device);
  copy_(out, x, non_blocking);
  return out;
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  for (const Tensor& x : xs)
    if (x.is_subclass()) return intercept_one({OpId::cat, "cat", xs});
  TS_CHECK(!xs.empty(), "cat: expected at least one tensor");
  const Tensor& first = xs[0];
  dim = wrap_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  int64_t total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& t = xs[i];
    TS_CHECK(t.dtype() == first.dtype() && t.device() == first.device(),
             "cat: tensor {} is {} on {}, tensor 0 is {} on {}", i, dtype_name(t.dtype()),
             t.device().str(), dtype_name(first.dtype()), first.device().str());
    TS_CHECK(t.dim() == first.dim(), "cat: tensor {} has shape {}, tensor 0 has shape {}", i,
             shape_str(t.shape()), shape_str(first.shape()));
    for (int64_t d = 0; d < t.dim(); ++d)
      TS_CHECK(d == dim || t.shape()[d] == shape[d],
               "cat: tensor {} has shape {} but tensor 0 has {} (they may differ only in dim {})",
               i, shape_str(t.shape()), shape_str(shape), dim);
    total += t.shape()[dim];
  }
  shape[dim] = total;
  Tensor out = empty(shape, first.dtype(), first.device());
  int64_t start = 0;
  for (const Tensor& t : xs) {
    Tensor dst = narrow(out, dim, start, t.shape()[dim]);
    dispatch(out.device()).copy(dst, t);
    start += t.shape()[dim];
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  for (const Tensor& x : xs)
    if (x.is_subclass()) return intercept_one({OpId::stack, "stack", xs});
  TS_CHECK(!xs.empty(), "stack: expected at least one tensor");
  dim = wrap_dim(dim, xs[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (size_t i = 0; i < xs.size(); ++i) {
    TS_CHECK(xs[i].shape() == xs[0].shape(), "stack: tensor {} has shape {}, tensor 0 has {}", i,
             shape_str(xs[i].shape()), shape_str(xs[0].shape()));
    parts.push_back(unsqueeze(xs[i], dim));
  }
  return cat(parts, dim);
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TS_CHECK(da == db || da == 1 || db == 1,
             "{}: shapes {} and {} cannot be broadcast (dim {}: {} vs {})", op, shape_str(a),
             shape_str(b), i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  TS_CHECK(lead >= 0, "sum_to: cannot reduce shape {} to {}", shape_str(grad.shape()),
           shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < grad.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && grad.shape()[d] != 1)) dims.push_back(d);
  Tensor s = dims.empty() ? grad : sum(grad, dims, true);
  return reshape(s, shape);
}

}  // namespace tessera::ops
