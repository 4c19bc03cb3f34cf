// Elementwise CUDA kernels: copy/convert, fill, unary math and its
// derivatives, binary ops with broadcasting, where and the in-place updates.
// The per-element formulas are runtime/math.h's, shared with the CPU.
#include <algorithm>

#include "runtime/cuda/device_util.cuh"

namespace tessera::cuda {

namespace {

// f32, bf16 or f16: copies between these go through f32 registers.
bool is_f32_or_narrower(DType dt) { return dt == DType::F32 || dt == DType::BF16 || dt == DType::F16; }

template <class C>
__global__ void copy_kernel(Iter<2> it) {
  TS_CUDA_LOOP(i, it.numel) {
    store<C>(it.data[0], it.dtype[0], offset_of(it, 0, i), load<C>(it.data[1], it.dtype[1], offset_of(it, 1, i)));
  }
}

__global__ void fill_kernel(Iter<1> it, double value) {
  TS_CUDA_LOOP(i, it.numel) { store<double>(it.data[0], it.dtype[0], offset_of(it, 0, i), value); }
}

template <class C>
__global__ void unary_kernel(ops::UnaryOp op, Iter<2> it) {
  TS_CUDA_LOOP(i, it.numel) {
    C x = load<C>(it.data[1], it.dtype[1], offset_of(it, 1, i));
    store<C>(it.data[0], it.dtype[0], offset_of(it, 0, i), math::apply_unary(op, x));
  }
}

template <class C>
__global__ void unary_backward_kernel(ops::UnaryOp op, Iter<4> it) {
  TS_CUDA_LOOP(i, it.numel) {
    C g = load<C>(it.data[1], it.dtype[1], offset_of(it, 1, i));
    C x = load<C>(it.data[2], it.dtype[2], offset_of(it, 2, i));
    C y = load<C>(it.data[3], it.dtype[3], offset_of(it, 3, i));
    store<C>(it.data[0], it.dtype[0], offset_of(it, 0, i), math::apply_unary_backward(op, g, x, y));
  }
}

// Operands a and b: from the iterator (slot >= 0) or the scalar.
template <class C>
__global__ void binary_kernel(ops::BinaryOp op, Iter<3> it, int a_slot, int b_slot, double scalar) {
  TS_CUDA_LOOP(i, it.numel) {
    C a = a_slot < 0 ? static_cast<C>(scalar) : load<C>(it.data[a_slot], it.dtype[a_slot], offset_of(it, a_slot, i));
    C b = b_slot < 0 ? static_cast<C>(scalar) : load<C>(it.data[b_slot], it.dtype[b_slot], offset_of(it, b_slot, i));
    int64_t o = offset_of(it, 0, i);
    if (math::is_compare(op)) static_cast<bool*>(it.data[0])[o] = math::apply_compare(op, a, b);
    else store<C>(it.data[0], it.dtype[0], o, math::apply_binary(op, a, b));
  }
}

template <class C>
__global__ void where_kernel(Iter<4> it) {
  TS_CUDA_LOOP(i, it.numel) {
    bool c = static_cast<const bool*>(it.data[1])[offset_of(it, 1, i)];
    int k = c ? 2 : 3;
    store<C>(it.data[0], it.dtype[0], offset_of(it, 0, i), load<C>(it.data[k], it.dtype[k], offset_of(it, k, i)));
  }
}

template <class C, PointwiseOp Op>
__global__ void pointwise_kernel(Iter<3> it, C s) {
  TS_CUDA_LOOP(i, it.numel) {
    int64_t o = offset_of(it, 0, i);
    C x = load<C>(it.data[0], it.dtype[0], o);
    C a = load<C>(it.data[1], it.dtype[1], offset_of(it, 1, i));
    C b = load<C>(it.data[2], it.dtype[2], offset_of(it, 2, i));
    math::apply_pointwise<Op>(x, a, b, s);
    store<C>(it.data[0], it.dtype[0], o, x);
  }
}

template <class C>
__global__ void clamp_kernel(Iter<1> it, C lo, C hi) {
  TS_CUDA_LOOP(i, it.numel) {
    int64_t o = offset_of(it, 0, i);
    C v = load<C>(it.data[0], it.dtype[0], o);
    store<C>(it.data[0], it.dtype[0], o, v < lo ? lo : (v > hi ? hi : v));
  }
}


// Up to kAdamWPerLaunch tensors per launch, passed by value (kernel
// parameters stay far below their 4 KiB limit); blockIdx.y picks the tensor.
constexpr int kAdamWPerLaunch = 32;
struct AdamWBatch {
  AdamWTensor t[kAdamWPerLaunch];
};

template <class C>
__global__ void adamw_kernel(AdamWBatch batch, math::AdamWConstants<C> k) {
  const AdamWTensor& t = batch.t[blockIdx.y];
  TS_CUDA_LOOP(i, t.n) {
    C p = load<C>(t.p, t.dtype, i), g = load<C>(t.g, t.dtype, i);
    C m = load<C>(t.m, t.dtype, i), v = load<C>(t.v, t.dtype, i);
    math::adamw_update(p, g, m, v, k);
    store<C>(t.p, t.dtype, i, p);
    store<C>(t.m, t.dtype, i, m);
    store<C>(t.v, t.dtype, i, v);
  }
}

constexpr int kScalePerLaunch = 64;
struct ScaleBatch {
  ScaleTensor t[kScalePerLaunch];
};

__global__ void scale_kernel(ScaleBatch batch, const double* coef) {
  const ScaleTensor& t = batch.t[blockIdx.y];
  const double c = *coef;
  if (t.dtype == DType::F64) {
    TS_CUDA_LOOP(i, t.n) store<double>(t.p, t.dtype, i, __dmul_rn(load<double>(t.p, t.dtype, i), c));
  } else {
    const float v = static_cast<float>(c);
    TS_CUDA_LOOP(i, t.n) store<float>(t.p, t.dtype, i, __fmul_rn(load<float>(t.p, t.dtype, i), v));
  }
}

}  // namespace

void launch_copy(const Iter<2>& it, cudaStream_t stream) {
  if (it.numel == 0) return;
  unsigned grid = grid_for(it.numel);
  if (is_integral(it.dtype[0]) && is_integral(it.dtype[1])) copy_kernel<int64_t><<<grid, kThreads, 0, stream>>>(it);
  else if (is_f32_or_narrower(it.dtype[0]) && is_f32_or_narrower(it.dtype[1])) copy_kernel<float><<<grid, kThreads, 0, stream>>>(it);
  else copy_kernel<double><<<grid, kThreads, 0, stream>>>(it);
  check_launch("copy");
}

void launch_fill(const Iter<1>& it, double value, cudaStream_t stream) {
  if (it.numel == 0) return;
  fill_kernel<<<grid_for(it.numel), kThreads, 0, stream>>>(it, value);
  check_launch("fill");
}

void launch_unary(ops::UnaryOp op, const Iter<2>& it, cudaStream_t stream) {
  if (it.numel == 0) return;
  with_float(it.dtype[0], [&](auto c) {
    unary_kernel<decltype(c)><<<grid_for(it.numel), kThreads, 0, stream>>>(op, it);
  });
  check_launch("unary");
}

void launch_unary_backward(ops::UnaryOp op, const Iter<4>& it, cudaStream_t stream) {
  if (it.numel == 0) return;
  with_float(it.dtype[0], [&](auto c) {
    unary_backward_kernel<decltype(c)><<<grid_for(it.numel), kThreads, 0, stream>>>(op, it);
  });
  check_launch("unary_backward");
}

namespace {
void binary_any(ops::BinaryOp op, const Iter<3>& it, int a_slot, int b_slot, double scalar,
                cudaStream_t stream) {
  if (it.numel == 0) return;
  unsigned grid = grid_for(it.numel);
  DType dt = it.dtype[a_slot >= 0 ? a_slot : b_slot];
  switch (dt) {
    case DType::F64: binary_kernel<double><<<grid, kThreads, 0, stream>>>(op, it, a_slot, b_slot, scalar); break;
    case DType::I32:
    case DType::I64: binary_kernel<int64_t><<<grid, kThreads, 0, stream>>>(op, it, a_slot, b_slot, scalar); break;
    case DType::Bool: binary_kernel<bool><<<grid, kThreads, 0, stream>>>(op, it, a_slot, b_slot, scalar); break;
    default: binary_kernel<float><<<grid, kThreads, 0, stream>>>(op, it, a_slot, b_slot, scalar); break;
  }
  check_launch("binary");
}
}  // namespace

void launch_binary(ops::BinaryOp op, const Iter<3>& it, cudaStream_t stream) {
  binary_any(op, it, 1, 2, 0.0, stream);
}

void launch_binary_scalar(ops::BinaryOp op, const Iter<2>& it, double s, bool scalar_first,
                          cudaStream_t stream) {
  Iter<3> three;
  three.ndim = it.ndim;
  three.numel = it.numel;
  three.contiguous = it.contiguous;
  for (int d = 0; d < kMaxDims; ++d) {
    three.sizes[d] = it.sizes[d];
    for (int k = 0; k < 2; ++k) three.strides[k][d] = it.strides[k][d];
  }
  for (int k = 0; k < 2; ++k) {
    three.data[k] = it.data[k];
    three.dtype[k] = it.dtype[k];
  }
  three.data[2] = it.data[1];  // unused slot, kept valid
  three.dtype[2] = it.dtype[1];
  binary_any(op, three, scalar_first ? -1 : 1, scalar_first ? 1 : -1, s, stream);
}

void launch_where(const Iter<4>& it, cudaStream_t stream) {
  if (it.numel == 0) return;
  unsigned grid = grid_for(it.numel);
  if (is_integral(it.dtype[0])) where_kernel<int64_t><<<grid, kThreads, 0, stream>>>(it);
  else where_kernel<double><<<grid, kThreads, 0, stream>>>(it);  // exact for every float dtype
  check_launch("where");
}

void launch_pointwise(PointwiseOp op, const Iter<3>& it, double s, cudaStream_t stream) {
  if (it.numel == 0) return;
  unsigned grid = grid_for(it.numel);
  with_float(it.dtype[0], [&](auto c) {
    using C = decltype(c);
    C sc = static_cast<C>(s);
    switch (op) {
      case PointwiseOp::AddScaled: pointwise_kernel<C, PointwiseOp::AddScaled><<<grid, kThreads, 0, stream>>>(it, sc); break;
      case PointwiseOp::Addcmul: pointwise_kernel<C, PointwiseOp::Addcmul><<<grid, kThreads, 0, stream>>>(it, sc); break;
      case PointwiseOp::Addcdiv: pointwise_kernel<C, PointwiseOp::Addcdiv><<<grid, kThreads, 0, stream>>>(it, sc); break;
      case PointwiseOp::Lerp: pointwise_kernel<C, PointwiseOp::Lerp><<<grid, kThreads, 0, stream>>>(it, sc); break;
    }
  });
  check_launch("pointwise");
}

void launch_clamp(const Iter<1>& it, double lo, double hi, cudaStream_t stream) {
  if (it.numel == 0) return;
  with_float(it.dtype[0], [&](auto c) {
    using C = decltype(c);
    clamp_kernel<C><<<grid_for(it.numel), kThreads, 0, stream>>>(it, static_cast<C>(lo), static_cast<C>(hi));
  });
  check_launch("clamp");
}

namespace {

// Hands the tensors `take` accepts (and that have elements) to `launch` in
// batches of up to N (Batch::t), with the grid the longest of a batch needs:
// a fixed number of tensors per launch, passed by value.
template <class Batch, int N, class T, class Take, class Launch>
void in_batches(const T* tensors, int64_t count, Take&& take, Launch&& launch) {
  Batch batch{};
  int used = 0;
  int64_t longest = 0;
  auto flush = [&] {
    if (used == 0) return;
    launch(batch, dim3(std::min(grid_for(longest), 4096u), static_cast<unsigned>(used)));
    used = 0;
    longest = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    if (tensors[i].n == 0 || !take(tensors[i])) continue;
    batch.t[used++] = tensors[i];
    longest = std::max(longest, tensors[i].n);
    if (used == N) flush();
  }
  flush();
}

}  // namespace

void launch_adamw(const AdamWTensor* tensors, int64_t count, const ops::AdamWStep& step,
                  cudaStream_t stream) {
  // f64 tensors compute in f64, the others in f32: one launch per kind and batch.
  for (bool f64 : {false, true})
    in_batches<AdamWBatch, kAdamWPerLaunch>(
        tensors, count, [f64](const AdamWTensor& t) { return (t.dtype == DType::F64) == f64; },
        [&](const AdamWBatch& batch, dim3 grid) {
          if (f64) adamw_kernel<double><<<grid, kThreads, 0, stream>>>(batch, math::adamw_constants<double>(step));
          else adamw_kernel<float><<<grid, kThreads, 0, stream>>>(batch, math::adamw_constants<float>(step));
          check_launch("adamw");
        });
}

void launch_scale(const ScaleTensor* tensors, int64_t count, const double* coef, cudaStream_t stream) {
  in_batches<ScaleBatch, kScalePerLaunch>(
      tensors, count, [](const ScaleTensor&) { return true; },
      [&](const ScaleBatch& batch, dim3 grid) {
        scale_kernel<<<grid, kThreads, 0, stream>>>(batch, coef);
        check_launch("scale_");
      });
}

}  // namespace tessera::cuda
