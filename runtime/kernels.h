// The kernel table: one entry per (op, device). The ops in runtime/ops.h check
// shapes, allocate outputs and pick the table for their tensors' device; a
// backend fills one table. Every kernel is enqueued on its device's current
// stream (runtime/stream.h): on the CPU it runs before the call returns, on
// another device later, so a kernel never returns a value to the host. Float
// kernels see the dtypes their table's compute_dtype maps inputs to, per
// kernel family (the CPU: f32 or f64 everywhere; the ops layer converts around
// the kernels, so a native bf16 family gets bf16); the 2-D kernels expect
// contiguous row-major inputs unless a comment says otherwise.
#pragma once

#include <vector>

#include "runtime/kernel_kinds.h"
#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera {

struct KernelTable {
  // The dtype the float kernels of `family` compute in for tensors of `dtype`
  // (which dtypes this backend takes natively, op family by op family; the
  // CPU's: runtime/cpu/table.cpp).
  DType (*compute_dtype)(KernelFamily family, DType dtype);
  // Same shape, any strides, any dtypes (converting).
  void (*copy)(const Tensor& dst, const Tensor& src);
  // Between this device and host memory: the Device::cpu() side (src of
  // copy_from_host, dst of copy_to_host) is kept alive until the copy ran. The
  // caller synchronizes the stream before the host reads a copy_to_host result.
  void (*copy_from_host)(const Tensor& dst, const Tensor& src);
  void (*copy_to_host)(const Tensor& dst, const Tensor& src);
  void (*fill)(const Tensor& dst, double value);
  // out and x share a float dtype; out contiguous.
  void (*unary)(ops::UnaryOp op, const Tensor& out, const Tensor& x);
  void (*unary_backward)(ops::UnaryOp op, const Tensor& gx, const Tensor& gy, const Tensor& x,
                         const Tensor& y);
  // a, b expanded to out's shape (any strides); out may alias a; bool out for comparisons.
  void (*binary)(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
  void (*binary_scalar)(ops::BinaryOp op, const Tensor& out, const Tensor& a, double s,
                        bool scalar_first);
  void (*where)(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
  // In-place on x (any strides); a, b expanded to x's shape; b unused for AddScaled/Lerp.
  void (*pointwise)(PointwiseOp op, const Tensor& x, const Tensor& a, const Tensor& b, double s);
  void (*clamp)(const Tensor& x, double lo, double hi);
  // x contiguous viewed as [outer, n, inner]; out [outer, inner] (Sum accumulates in f64).
  void (*reduce)(ReduceOp op, const Tensor& out, const Tensor& x, int64_t outer, int64_t n,
                 int64_t inner);
  // x contiguous [rows, n] -> values [rows], i64 indices [rows] (first maximum).
  void (*argmax_rows)(const Tensor& values, const Tensor& indices, const Tensor& x);
  // out (one f64 element) = the sum of every x's squared elements (each x
  // contiguous, of any floating dtype, squared in f64): one pass over many
  // tensors, e.g. all gradients.
  void (*sum_squares)(const Tensor& out, const std::vector<Tensor>& xs);
  // C = alpha * op(A) op(B) + beta * C; row-major; A, B and C in `dtype`, a
  // compute dtype of KernelFamily::Matmul.
  void (*gemm)(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
               double alpha, const void* a, int64_t lda, const void* b, int64_t ldb, double beta,
               void* c, int64_t ldc);
  // AdamW on every (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]): each
  // contiguous, of one float dtype (bf16/f16 computed in f32).
  void (*adamw)(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                const ops::AdamWStep& step);
  // Rows of the last dim, contiguous.
  void (*softmax)(const Tensor& out, const Tensor& x, bool log);
  void (*softmax_backward)(const Tensor& gx, const Tensor& gy, const Tensor& y, bool log);
  void (*layer_norm)(const ops::NormResult& r, const Tensor& x, const Tensor& w, const Tensor& b,
                     double eps, bool rms);
  void (*layer_norm_backward)(const ops::NormGrads& g, const Tensor& dy, const Tensor& x,
                              const Tensor& w, const Tensor& mean, const Tensor& rstd, bool rms);
  void (*embedding)(const Tensor& out, const Tensor& weight, const Tensor& indices);
  void (*embedding_backward)(const Tensor& gw, const Tensor& grad, const Tensor& indices);
  void (*cross_entropy)(const Tensor& losses, const Tensor& lse, const Tensor& logits,
                        const Tensor& target, int64_t ignore_index);
  // scale: a 0-dim f64 tensor (d loss / d mean, over the counted targets).
  void (*cross_entropy_backward)(const Tensor& glogits, const Tensor& scale, const Tensor& logits,
                                 const Tensor& target, const Tensor& lse, int64_t ignore_index);
  void (*attention)(const ops::AttentionResult& r, const Tensor& q, const Tensor& k,
                    const Tensor& v, bool causal, double scale);
  void (*attention_backward)(const ops::AttentionGrads& g, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& lse, bool causal, double scale);
  // out and x [..., t, d] contiguous; cos, sin [t, d / 2] in x's statistics
  // dtype (f32 for bf16/f16 x, as attention's lse).
  void (*rope)(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin,
               bool inverse);
  // Random fills (see runtime/random.h); x contiguous float.
  void (*uniform)(const Tensor& x, double low, double high, const RandomSpec& spec);
  void (*normal)(const Tensor& x, double mean, double std, const RandomSpec& spec);
};

// The table for a device; throws for a device this build has no kernels for.
const KernelTable& kernels(Device device);
// What ops call: an op boundary (runs the hook below), then kernels(device).
const KernelTable& dispatch(Device device);
// Installs `table` for devices of `type` in place of the built-in one (nullptr
// restores it) and returns what was installed: lets a test check what the ops
// layer hands a backend with other native dtypes. Not thread-safe.
const KernelTable* replace_kernels_for_testing(DeviceType type, const KernelTable* table);
// Runs at every op boundary. dist registers MPI progress here in poll mode
// (TESSERA_PROGRESS=poll); nothing runs otherwise.
void set_op_boundary_hook(void (*hook)());

namespace cpu {
const KernelTable& table();  // the instruction-set copy in use (runtime/cpu/isa.h)
}
namespace async_cpu {
extern const KernelTable kTable;  // the CPU kernels, queued on async_cpu streams
}

}  // namespace tessera
