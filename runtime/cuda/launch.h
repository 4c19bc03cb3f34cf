// The CUDA kernels' launchers: what runtime/cuda/table.cpp (host C++) calls
// with plain pointers, dtypes and sizes. Every launcher queues its kernels on
// `stream` and returns at once. Float data may be f32, f64, bf16 or f16: the
// kernels load it into f32 registers (f64 into f64), compute, and round once
// on the store, as the CPU does around its f32 kernels.
#pragma once

#include <cuda_runtime.h>

#include "runtime/cuda/iter.h"
#include "runtime/kernel_kinds.h"

namespace tessera::cuda {

// ---- elementwise (elementwise.cu) ----------------------------------------------
void launch_copy(const Iter<2>& it, cudaStream_t stream);
void launch_fill(const Iter<1>& it, double value, cudaStream_t stream);
void launch_unary(ops::UnaryOp op, const Iter<2>& it, cudaStream_t stream);
void launch_unary_backward(ops::UnaryOp op, const Iter<4>& it, cudaStream_t stream);  // gx, gy, x, y
void launch_binary(ops::BinaryOp op, const Iter<3>& it, cudaStream_t stream);
// out = a op s, or s op a.
void launch_binary_scalar(ops::BinaryOp op, const Iter<2>& it, double s, bool scalar_first,
                          cudaStream_t stream);
void launch_where(const Iter<4>& it, cudaStream_t stream);  // out, cond, a, b
void launch_pointwise(PointwiseOp op, const Iter<3>& it, double s, cudaStream_t stream);  // x, a, b
void launch_clamp(const Iter<1>& it, double lo, double hi, cudaStream_t stream);
// AdamW over many contiguous tensors (each p, g, m, v of one float dtype), a
// fixed number of tensors per launch (PyTorch's multi_tensor_apply does the same).
struct AdamWTensor {
  void* p;
  const void* g;
  void* m;
  void* v;
  int64_t n;
  DType dtype;
};
void launch_adamw(const AdamWTensor* tensors, int64_t count, const ops::AdamWStep& step,
                  cudaStream_t stream);
// Every tensor times *coef (read on the device), in f32 (f64 for f64) and
// rounded once; a fixed number of tensors per launch, as AdamW.
struct ScaleTensor {
  void* p;
  int64_t n;
  DType dtype;
};
void launch_scale(const ScaleTensor* tensors, int64_t count, const double* coef, cudaStream_t stream);

// ---- reductions (reduce.cu) -----------------------------------------------------
// x contiguous [outer, n, inner] -> out [outer, inner] (both `dtype`; Sum in f64).
// Columns (inner > 1) of many rows reduce in two passes: chunks of
// reduce_chunk_rows(...) rows each into `scratch` (f64, or i64 for integers;
// reduce_scratch_elements(...) of them), then the chunks in a fixed order,
// so that a bias gradient (768 columns of 8192 rows) fills the device and its
// result does not depend on the launch. scratch may be null when
// reduce_scratch_elements is 0.
void launch_reduce(ReduceOp op, void* out, const void* x, DType dtype, int64_t outer, int64_t n,
                   int64_t inner, void* scratch, cudaStream_t stream);
int64_t reduce_scratch_elements(int64_t outer, int64_t n, int64_t inner);
// x contiguous [rows, n] -> values [rows] (dtype), indices [rows] (first maximum; NaN wins).
void launch_argmax_rows(void* values, int64_t* indices, const void* x, DType dtype, int64_t rows,
                        int64_t n, cudaStream_t stream);
// Adds the squares of every tensor's elements, in f64, into `partials`
// (kSumSquaresBlocks slots, one per block: a fixed order, so the result is
// deterministic); up to 64 tensors per launch.
constexpr int kSumSquaresBlocks = 64;
struct SquaresTensor {
  const void* p;
  int64_t n;
  DType dtype;
};
void launch_sum_squares_partials(double* partials, const SquaresTensor* xs, int64_t count, cudaStream_t stream);
// out[0] = the sum of n doubles, in index order within a fixed tree.
void launch_sum_doubles(double* out, const double* xs, int64_t n, cudaStream_t stream);

// ---- neural-network ops (nn.cu); rows of the last dim, contiguous ------------------
void launch_softmax(void* out, const void* x, DType dtype, int64_t rows, int64_t n, bool log,
                    cudaStream_t stream);
void launch_softmax_backward(void* gx, const void* gy, const void* y, DType dtype, int64_t rows,
                             int64_t n, bool log, cudaStream_t stream);
// mean (nullable for RMSNorm) and rstd in `stats` dtype (f32, or f64 for f64 inputs).
void launch_layer_norm(void* y, void* mean, void* rstd, const void* x, const void* w,
                       const void* b, DType dtype, DType stats, int64_t rows, int64_t n,
                       double eps, bool rms, cudaStream_t stream);
// dw/db nullable; `scratch` holds 2 * kNormRowBlocks * n doubles.
constexpr int kNormRowBlocks = 32;
void launch_layer_norm_backward(void* dx, void* dw, void* db, const void* dy, const void* x,
                                const void* w, const void* mean, const void* rstd, DType dtype,
                                DType stats, int64_t rows, int64_t n, bool rms, double* scratch,
                                cudaStream_t stream);
void launch_embedding(void* out, const void* weight, DType dtype, const void* indices,
                      DType index_dtype, int64_t count, int64_t num, int64_t d, DeviceError* err,
                      cudaStream_t stream);
// gw += rows of grad at indices: sorted by row (stable), then one block per
// distinct row adding its positions in order (the CPU's order, so the same
// bits); parallel over rows and columns. `scratch` holds
// embedding_backward_scratch_bytes(count) bytes.
size_t embedding_backward_scratch_bytes(int64_t count);
void launch_embedding_backward(void* gw, const void* grad, DType dtype, const void* indices,
                               DType index_dtype, int64_t count, int64_t num, int64_t d,
                               DeviceError* err, void* scratch, cudaStream_t stream);
// targets i64; losses and lse in `stats`-compatible dtype of the logits' compute.
void launch_cross_entropy(void* losses, void* lse, const void* logits, DType dtype, DType lse_dtype,
                          const int64_t* target, int64_t rows, int64_t c, int64_t ignore_index,
                          DeviceError* err, cudaStream_t stream);
void launch_cross_entropy_backward(void* g, const double* scale, const void* logits, DType dtype,
                                   const void* lse, DType lse_dtype, const int64_t* target,
                                   int64_t rows, int64_t c, int64_t ignore_index,
                                   cudaStream_t stream);
// x, out [planes, t, 2 * half]; cos, sin [>= t, half] (rows 0..t-1 used).
void launch_rope(void* out, const void* x, const void* cos, const void* sin, DType dtype,
                 int64_t planes, int64_t t, int64_t half, bool inverse, cudaStream_t stream);

// ---- attention (attention.cu): q [B, H, T, D], k/v [B, Hkv, S, D], lse [B, H, T] ---
struct AttentionShape {
  int64_t batch, heads, kv_heads, t, s, d;
  bool causal;
  double scale;
};
void launch_attention(void* out, void* lse, const void* q, const void* k, const void* v,
                      DType dtype, DType lse_dtype, const AttentionShape& shape,
                      cudaStream_t stream);
// The largest head_dim the kernels take.
int max_attention_head_dim();
// `scratch`: batch * heads * t floats (the rows' dot(dout, out)).
// scratch: one element per query row (batch x heads x t) for its dot(dout,
// out), in the accumulation type: f64 for f64, else f32.
void launch_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                               const void* k, const void* v, const void* out, const void* lse,
                               DType dtype, DType lse_dtype, const AttentionShape& shape,
                               void* scratch, cudaStream_t stream);

// ---- random fills (random.cu): element i (row-major over sizes) draws counter
// base + sum(index_i[j] * index_strides[j]) (linear: base + i) -------------------
struct RandomArg {
  uint64_t seed, stream;
  int64_t base;
  bool linear;
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t index_strides[kMaxDims];
};
void launch_uniform(void* x, DType dtype, int64_t n, double low, double high, const RandomArg& r,
                    cudaStream_t stream);
void launch_normal(void* x, DType dtype, int64_t n, double mean, double std, const RandomArg& r,
                   cudaStream_t stream);

}  // namespace tessera::cuda
