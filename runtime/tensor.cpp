#include "runtime/tensor.h"

#include <atomic>
#include <cmath>

#include "runtime/ops.h"

namespace tessera {

namespace {
std::atomic<uint64_t> next_tensor_id{1};
}

TensorImpl::TensorImpl() : id(next_tensor_id.fetch_add(1, std::memory_order_relaxed)) {}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t leading_numel(const Shape& shape) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) n *= shape[i];
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
  return strides;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  int64_t lo = ndim > 0 ? -ndim : -1, hi = ndim > 0 ? ndim - 1 : 0;
  TS_CHECK(dim >= lo && dim <= hi, "{}: dim {} out of range for a {}-d tensor (expected {}..{})",
           op, dim, ndim, lo, hi);
  return dim < 0 ? dim + (ndim > 0 ? ndim : 1) : dim;
}

int64_t Tensor::size(int64_t dim) const { return shape()[wrap_dim(dim, this->dim(), "size")]; }

int64_t Tensor::stride(int64_t dim) const {
  return strides()[wrap_dim(dim, this->dim(), "stride")];
}

bool Tensor::is_contiguous() const {
  const auto& sh = shape();
  const auto& st = strides();
  int64_t expected = 1;
  for (size_t i = sh.size(); i-- > 0;) {
    if (sh[i] == 1) continue;
    if (sh[i] == 0) return true;
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  const TensorImpl& t = checked();
  TS_CHECK(t.subclass == nullptr, "data_ptr: this tensor is a {}, with no bytes of its own; {}", t.subclass->str(),
           t.subclass->no_bytes_hint());
  TS_CHECK(!t.device.is_meta(), "data_ptr: tensor {} is on the meta device and has no bytes",
           shape_str(t.shape));
  TS_CHECK(t.storage != nullptr, "data_ptr: tensor has no storage");
  TS_CHECK(t.storage->is_allocated(), "data_ptr: the storage of tensor {} has been released ({})",
           shape_str(t.shape),
           t.storage->release_note.empty()
               ? "used after its owner released it (a sharded parameter while resharded? run the module as "
                 "module(x), whose hooks gather it)"
               : t.storage->release_note);
  return static_cast<char*>(t.storage->data()) + t.offset * dtype_size(t.dtype);
}

void* Tensor::host_data_ptr() const {
  TS_CHECK(is_meta() || device().is_host_visible(),
           "tensor {} ({}) is on {}, whose memory the host cannot read; copy it first (t.to(Device::cpu()))",
           shape_str(shape()), dtype_name(dtype()), device().str());
  return data_ptr();
}

double Tensor::item() const {
  TS_CHECK(numel() == 1, "item: expected a tensor with one element, got shape {}",
           shape_str(shape()));
  return ops::to(ops::to(*this, Device::cpu()), DType::F64).data<double>()[0];
}

Tensor Tensor::to(Device device, bool non_blocking) const { return ops::to(*this, device, non_blocking); }

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = ops::contiguous(ops::to(ops::to(*this, Device::cpu()), DTypeOf<T>::value));
  const T* p = c.numel() > 0 ? c.data<T>() : nullptr;
  return std::vector<T>(p, p + c.numel());
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;

bool Tensor::requires_grad() const {
  return defined() && impl_->autograd != nullptr && impl_->autograd->requires_grad;
}

Tensor& Tensor::set_requires_grad(bool requires_grad) {
  TS_CHECK(!requires_grad || is_floating(dtype()),
           "set_requires_grad: only floating-point tensors can require gradients (got {})",
           dtype_name(dtype()));
  if (!requires_grad && impl_->autograd == nullptr) return *this;
  TS_CHECK(is_leaf() || requires_grad,
           "set_requires_grad(false) on a non-leaf tensor: use detach() instead");
  autograd_meta().requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const { return impl_->autograd == nullptr || impl_->autograd->is_leaf; }

Tensor Tensor::grad() const {
  if (impl_->autograd == nullptr || impl_->autograd->grad == nullptr) return {};
  return Tensor(impl_->autograd->grad);
}

void Tensor::set_grad(const Tensor& grad) const {
  if (grad.defined()) {
    TS_CHECK(grad.shape() == shape(), "set_grad: gradient shape {} does not match tensor shape {}",
             shape_str(grad.shape()), shape_str(shape()));
    TS_CHECK(grad.device() == device(), "set_grad: gradient on {} but tensor on {}",
             grad.device().str(), device().str());
  }
  autograd_meta().grad = grad.impl_;
}

AutogradMeta& Tensor::autograd_meta() const {
  if (checked().autograd == nullptr) impl_->autograd = std::make_unique<AutogradMeta>();
  return *impl_->autograd;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::string head = fmt::format("Tensor({}, {}, {}", shape_str(shape()), dtype_name(dtype()),
                                 device().str());
  if (is_subclass()) return head + ", " + impl_->subclass->str() + ")";
  if (device().is_meta() || !storage()->is_allocated() || numel() > 64) return head + ")";
  std::vector<double> v = to_vector<double>();
  return head + fmt::format(", [{:.6g}])", fmt::join(v, ", "));
}

Tensor make_tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset,
                   DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->device = storage->device();
  impl->storage = std::move(storage);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    TS_CHECK(d >= 0, "empty: negative dimension in shape {}", shape_str(shape));
  size_t nbytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  return make_tensor(std::make_shared<Storage>(nbytes, device), shape, contiguous_strides(shape),
                     0, dtype);
}

}  // namespace tessera
