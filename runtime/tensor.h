// Tensor: a refcounted handle to a TensorImpl (storage, offset, shape, strides,
// dtype, device). Views share storage. Math lives in free functions: the raw
// kernels-level ones in `tessera::ops` (runtime/ops.h) and the differentiable
// ones a user calls in `tessera` (autograd/functions.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/check.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/storage.h"

namespace tessera {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);  // "[4, 3]"
int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
// Product of all dims but the last (the row count of x viewed as [rows, last]).
int64_t leading_numel(const Shape& shape);
// Wraps a possibly negative dim into [0, ndim); throws naming `op` when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);

class Tensor;
struct TensorImpl;

// Autograd's per-tensor fields. They are plain data here; autograd/ gives them
// meaning (runtime never includes autograd).
struct AutogradMeta {
  bool requires_grad = false;
  bool is_leaf = true;        // false once produced by a recorded op
  bool retains_grad = false;  // non-leaf keeps .grad (retain_grad)
  std::shared_ptr<TensorImpl> grad;
  std::vector<std::function<Tensor(const Tensor&)>> hooks;  // may replace the gradient
  std::vector<std::function<void(const Tensor&)>> post_accumulate_grad_hooks;  // leaves only
};

// What a tensor subclass carries (PyTorch's wrapper subclasses): a tensor whose
// impl has the logical shape and no bytes of its own, and whose ops are handed
// to the layer that made it (runtime/op_call.h). runtime/ only holds it; the
// layer above defines and interprets it.
struct TensorSubclass {
  virtual ~TensorSubclass() = default;
  virtual std::string str() const = 0;
  // Why such a tensor's bytes cannot be read, and what to use instead.
  virtual std::string no_bytes_hint() const = 0;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;  // null for a subclass tensor (its bytes live elsewhere)
  int64_t offset = 0;                // in elements
  Shape shape;
  Shape strides;  // in elements
  DType dtype = DType::F32;
  Device device;
  uint64_t id;  // unique per impl; autograd routes gradients by it
  std::unique_ptr<AutogradMeta> autograd;
  std::shared_ptr<TensorSubclass> subclass;

  TensorImpl();
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  const Shape& shape() const { return checked().shape; }
  int64_t size(int64_t dim) const;  // negative dims count from the end
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t numel() const { return shape_numel(shape()); }
  const Shape& strides() const { return checked().strides; }
  int64_t stride(int64_t dim) const;
  int64_t storage_offset() const { return checked().offset; }
  DType dtype() const { return checked().dtype; }
  Device device() const { return checked().device; }
  bool is_contiguous() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  const std::shared_ptr<Storage>& storage() const { return checked().storage; }

  // Raw element pointer (at the tensor's offset), on any device: the host may
  // dereference it only where device().is_host_visible() (data<T>() checks).
  // Throws for meta tensors, subclass tensors and released storage.
  void* data_ptr() const;
  // data_ptr() for code that reads or writes the bytes on the host (file I/O,
  // checksums): refuses a tensor whose memory the host cannot read.
  void* host_data_ptr() const;
  // Typed host pointer; refuses a tensor whose bytes the host cannot read.
  template <class T>
  T* data() const {
    TS_CHECK(DTypeOf<T>::value == dtype(), "data<{}>() called on a {} tensor",
             dtype_name(DTypeOf<T>::value), dtype_name(dtype()));
    return static_cast<T*>(host_data_ptr());
  }
  // A copy on `device` (this tensor when already there); see ops::to.
  Tensor to(Device device, bool non_blocking = false) const;
  // The value of a one-element tensor, converted to double (a host sync off the CPU).
  double item() const;
  // Copies the elements, in row-major order, converted to T (a host sync off the CPU).
  template <class T>
  std::vector<T> to_vector() const;

  // Autograd fields (autograd/ implements the semantics).
  bool requires_grad() const;
  // Only floating-point tensors can require grad.
  Tensor& set_requires_grad(bool requires_grad);
  bool is_leaf() const;
  Tensor grad() const;  // undefined when there is none
  void set_grad(const Tensor& grad) const;
  AutogradMeta& autograd_meta() const;  // created on first use

  // A subclass tensor: its ops go through runtime/op_call.h.
  bool is_subclass() const { return defined() && impl_->subclass != nullptr; }
  bool is_meta() const { return device().is_meta(); }

  std::string str() const;  // shape, dtype, device and (small tensors) values

 private:
  const TensorImpl& checked() const {
    TS_CHECK(impl_ != nullptr, "use of an undefined tensor");
    return *impl_;
  }
  std::shared_ptr<TensorImpl> impl_;
};

using TensorList = std::vector<Tensor>;

// A new tensor viewing `storage` (no copy).
Tensor make_tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset,
                   DType dtype);
// A fresh contiguous tensor with uninitialised contents (no bytes on meta).
Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());

}  // namespace tessera
