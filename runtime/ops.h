// Raw tensor operations: shape checks, output allocation, and a call into the
// device's kernel table. No autograd here: the differentiable versions a user
// calls live in autograd/functions.h and are built on these.
#pragma once

#include <array>
#include <optional>
#include <utility>

#include "runtime/op_kinds.h"
#include "runtime/tensor.h"

namespace tessera::ops {

// ---- views: share storage, no copy ----------------------------------------
Tensor as_strided(const Tensor& x, const Shape& shape, const Shape& strides, int64_t offset);
Tensor view(const Tensor& x, Shape shape);  // one -1 allowed; needs compatible strides
Tensor reshape(const Tensor& x, Shape shape);  // a view when possible, else a copy
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor expand(const Tensor& x, const Shape& shape);  // -1 keeps a dim
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor squeeze(const Tensor& x);  // all size-1 dims
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor alias(const Tensor& x);  // a new impl over the same bytes (detach)
// torch.chunk semantics: pieces of ceil(n/chunks); may return fewer than `chunks`.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes,
                                     int64_t dim = 0);


// The dtype the kernels of `family` on `device` compute in for inputs of
// `dtype`: the kernel table's choice (the CPU widens bf16/f16 to f32 around
// every family and rounds once at the end; a backend with native bf16 kernels
// keeps bf16 for the families it has them for).
DType compute_dtype(Device device, KernelFamily family, DType dtype);

// ---- copies -----------------------------------------------------------------
Tensor contiguous(const Tensor& x);  // x itself when already contiguous
Tensor clone(const Tensor& x);
Tensor to(const Tensor& x, DType dtype);  // x itself when already that dtype
// A copy on another device (x itself when already there). Host -> device is
// queued on the device's current stream; device -> host then waits for that
// stream (a host sync) unless non_blocking, after which the host must
// synchronize before reading.
Tensor to(const Tensor& x, Device device, bool non_blocking = false);
Tensor cat(const std::vector<Tensor>& xs, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim = 0);
// Broadcast shape of two shapes; throws naming `op` when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Sums `grad` down to `shape` (the reverse of broadcasting).
Tensor sum_to(const Tensor& grad, const Shape& shape);

// ---- elementwise ------------------------------------------------------------
const char* unary_name(UnaryOp op);
Tensor unary(UnaryOp op, const Tensor& x);
// d(op)/dx times grad, given the input x and (for ops that prefer it) the output y.
Tensor unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y);

const char* binary_name(BinaryOp op);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);  // broadcasting; same dtype
Tensor binary(BinaryOp op, const Tensor& a, double b);
Tensor binary(BinaryOp op, double a, const Tensor& b);
inline Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Add, a, b); }
inline Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Sub, a, b); }
inline Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Mul, a, b); }
inline Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Div, a, b); }
inline Tensor add(const Tensor& a, double b) { return binary(BinaryOp::Add, a, b); }
inline Tensor mul(const Tensor& a, double b) { return binary(BinaryOp::Mul, a, b); }
inline Tensor neg(const Tensor& x) { return unary(UnaryOp::Neg, x); }
inline Tensor exp(const Tensor& x) { return unary(UnaryOp::Exp, x); }
inline Tensor sqrt(const Tensor& x) { return unary(UnaryOp::Sqrt, x); }
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);  // cond: bool

// ---- in-place (what an optimizer needs); return the mutated tensor ---------
// Broadcasts src, converts dtype, any two devices (a copy to the host waits
// for the source stream unless non_blocking).
const Tensor& copy_(const Tensor& dst, const Tensor& src, bool non_blocking = false);
const Tensor& fill_(const Tensor& x, double value);
const Tensor& zero_(const Tensor& x);
const Tensor& add_(const Tensor& x, const Tensor& other, double alpha = 1.0);  // x += alpha * other
const Tensor& add_(const Tensor& x, double value);
const Tensor& mul_(const Tensor& x, const Tensor& other);
const Tensor& mul_(const Tensor& x, double value);
const Tensor& div_(const Tensor& x, const Tensor& other);
const Tensor& addcmul_(const Tensor& x, const Tensor& a, const Tensor& b, double value = 1.0);
const Tensor& addcdiv_(const Tensor& x, const Tensor& a, const Tensor& b, double value = 1.0);
const Tensor& lerp_(const Tensor& x, const Tensor& end, double weight);  // x += weight * (end - x)
const Tensor& sqrt_(const Tensor& x);
const Tensor& clamp_(const Tensor& x, std::optional<double> min, std::optional<double> max);

// AdamW's update of many parameters in one pass over each (runtime/math.h,
// adamw_update): params[i] with grads[i], exp_avgs[i] and exp_avg_sqs[i]. Each
// quadruple adamw_fusable: one float dtype (bf16/f16 computed in f32 and
// rounded once per update), contiguous, one shape and device, plain tensors
// (not subclass tensors); no two share memory. Lists may mix dtypes; one device.
void adamw_(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
            const AdamWStep& step);
bool adamw_fusable(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                   const Tensor& exp_avg_sq);

// ---- reductions (dims empty = all dims) --------------------------------------
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false,
           std::optional<DType> out_dtype = std::nullopt);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, int64_t correction = 1,
           bool keepdim = false);
// Max over one dim: values and i64 indices (first occurrence).
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor max(const Tensor& x);  // over all elements
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
// Sum of squares over all elements of every tensor, in f64 (norms, gradient
// clipping): a 0-dim f64 tensor on `device`, one kernel for the whole list.
Tensor sum_squares(const std::vector<Tensor>& xs, Device device);
// Every xs[i] *= coef in place: coef a 0-dim float tensor on the tensors'
// device (read there, never by the host), the product in f32 (f64 for f64
// tensors) rounded once, the bits of mul_(x, coef.item()). One pass over many
// local, contiguous float tensors of any dtypes (clip_grad_norm_'s gradients).
void scale_(const std::vector<Tensor>& xs, const Tensor& coef);
double sum_squares(const Tensor& x);  // the same for one tensor, read on the host

// ---- linear algebra (OpenBLAS on CPU) ----------------------------------------
// 1-D/2-D/N-D like torch.matmul, batch dims broadcast. Transposed 2-D views are
// passed to BLAS as transposes, never copied.
Tensor matmul(const Tensor& a, const Tensor& b);
// y = x @ w^T + b for x [..., in], w [out, in], b [out] (optional).
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = {});
// The shapes matmul(a, b) and linear(x, w) give for operands of these shapes
// (throwing as the ops do when they do not fit).
Shape matmul_shape(const Shape& a, const Shape& b);
Shape linear_shape(const Shape& x, const Shape& w);
// The gradients of y = linear(x, w, b) given dy = grad: {dx, dw, db}, each
// computed only where `need` says (undefined otherwise).
TensorList linear_backward(const Tensor& grad, const Tensor& x, const Tensor& w, std::array<bool, 3> need);
// gelu(x + bias), bias [n] added along x's last dim (GPT-2's c_fc output and
// its activation, the tanh form where tanh_approx): one pass where the device
// has the fused kernel, the bits of add then gelu either way. Its backward
// gives {dx, dbias}: dbias is dx summed over x's rows, as sum gives it.
Tensor bias_gelu(const Tensor& x, const Tensor& bias, bool tanh_approx);
TensorList bias_gelu_backward(const Tensor& grad, const Tensor& x, const Tensor& bias, bool tanh_approx);
// out (+)= alpha * a @ b for 2-D a, b; a and b may be transposed views.
void gemm_into(Tensor& out, const Tensor& a, const Tensor& b, double alpha = 1.0,
               bool accumulate = false);

// ---- neural-network kernels -----------------------------------------------------
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim);
Tensor log_softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim);

struct NormResult {
  Tensor y;
  Tensor mean;  // layer_norm only; f32/f64 [rows]
  Tensor rstd;  // f32/f64 [rows]
};
// Normalises over the last dim; weight/bias [C] optional.
NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
struct NormGrads {
  Tensor dx, dweight, dbias;
};
NormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                              const Tensor& mean, const Tensor& rstd, bool need_weight_grads);
NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps);
NormGrads rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd, bool need_weight_grad);
// A pre-norm block's residual step: sum = x + residual, then its layer norm
// (RMS norm): the bits of add, then the norm, computed in one pass over each
// row where the device has the fused kernel (the add_layer_norm row of
// runtime/op_list.h). The backward is the norm's, at sum.
struct AddNormResult {
  Tensor sum;
  NormResult norm;
};
AddNormResult add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                             double eps);
AddNormResult add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps);

// weight [V, D], indices i32/i64 of any shape -> [..., D]. Out-of-range indices throw.
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_weights);
// The same, laid out as `weight` (whose values it does not read): a subclass
// table's gradient takes the table's layout.
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, const Tensor& weight);

// Fused log-softmax + NLL over logits [N, C] and i64 targets [N]; the mean over
// targets != ignore_index (0 if none). Returns the loss (0-dim) and the
// per-row logsumexp the backward reuses.
struct CrossEntropyResult {
  Tensor loss;
  Tensor lse;
  Tensor count;  // targets that were not ignored: a 0-dim f64 tensor on the logits' device
};
CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& target,
                                 int64_t ignore_index = -100);
Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits,
                              const Tensor& target, const Tensor& lse, int64_t ignore_index,
                              const Tensor& count);

// Causal (or full) scaled-dot-product attention, q [B, H, T, D], k/v [B, Hkv, S, D]
// (Hkv divides H: grouped-query attention). Memory-efficient: online softmax
// over key blocks; only one block of scores per thread. Returns out [B, H, T, D]
// and the logsumexp [B, H, T] (f32) for the backward.
struct AttentionResult {
  Tensor out, lse;
};
AttentionResult attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                          double scale);
struct AttentionGrads {
  Tensor dq, dk, dv;
};
AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  bool causal, double scale);
// Reference attention that materialises the score matrix (tests compare against it).
Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                           double scale);

// Rotary embedding on x [B, H, T, D] (D even, rotate-half pairing as in Llama),
// cos/sin [T, D/2]. `inverse` rotates by the negative angle (the backward).
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse = false);

}  // namespace tessera::ops
