// The differentiable tensor operations a user calls. Each one runs the raw op
// from runtime/ops.h and, when an input requires grad and grad mode is on,
// records its backward on the tape (autograd/tape.h).
#pragma once

#include <optional>
#include <utility>

#include "autograd/tape.h"
#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera {

// ---- shape and views ---------------------------------------------------------------
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor view(const Tensor& x, const Shape& shape);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor contiguous(const Tensor& x);
Tensor clone(const Tensor& x);
Tensor to(const Tensor& x, DType dtype);  // gradients flow back in x's dtype
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes,
                                     int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
Tensor cat(const TensorList& xs, int64_t dim = 0);
Tensor stack(const TensorList& xs, int64_t dim = 0);
inline Tensor detach(const Tensor& x) { return autograd::detach(x); }

// ---- elementwise ------------------------------------------------------------------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor pow(const Tensor& a, const Tensor& exponent);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor gelu(const Tensor& x, bool tanh_approximation = false);
Tensor silu(const Tensor& x);
// silu(gate) * up (Llama's MLP gate) in one fused kernel where the device has
// it (runtime/op_list.h's swiglu), the bits of silu then mul either way.
Tensor swiglu(const Tensor& gate, const Tensor& up);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor square(const Tensor& x);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// Comparisons return bool tensors and carry no gradient.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(const Tensor& a, double b) { return mul(a, 1.0 / b); }

// ---- reductions ----------------------------------------------------------------------
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, int64_t correction = 1,
           bool keepdim = false);
// Max over a dim: values (differentiable; the gradient goes to the first maximum) and indices.
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);

// ---- linear algebra and neural-network ops -------------------------------------------------
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
// gelu(linear(x, weight, bias)) with the bias added in GELU's pass, forward
// and backward (its gradient summed as GELU's backward stores): GPT-2's c_fc
// and its activation (nn::Linear with an activation). The product is saved
// without its bias. In bf16 and f16, and without a bias, it is
// gelu(linear(x, weight, bias)) (measured faster there).
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, bool tanh_approximation = false);
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
// A pre-norm block's residual step: {x + residual, layer_norm (rms_norm) of
// it}, the sum and its norm made in one pass over each row where the device
// has the fused kernel (llm.c's fused residual forward); the bits of the two
// ops either way, forward and backward.
std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                         const Tensor& bias, double eps = 1e-5);
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                       double eps = 1e-6);
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Mean cross-entropy of logits [N, C] against i64 targets [N]; ignored targets
// do not count (a batch with every target ignored gives 0, not NaN).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100);
// cross_entropy(linear(x, weight), target) without the [tokens, vocabulary]
// logits ever held whole (Liger's fused linear cross-entropy): the rows of x
// [..., C] go through in chunks of `chunk_rows` (<= 0: all at once), each
// chunk's logits [chunk, V] made, its loss summed, and (when x or weight
// needs a gradient) its gradient through the softmax and both products taken
// at once into dx and dweight, so the backward only scales them by the
// loss's gradient. The same FLOPs as the unchunked pair. Plain tensors only
// (nn::LanguageModel keeps the unchunked path for DTensors). bf16/f16
// weights' gradients are summed over the chunks in f32, rounded once.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& target, int64_t chunk_rows,
                            int64_t ignore_index = -100);
// Inverted dropout with the thread's default generator (identity when !training or p == 0).
Tensor dropout(const Tensor& x, double p, bool training);
// Attention over q [B, H, T, D], k/v [B, Hkv, S, D]; scale defaults to 1/sqrt(D).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = true, std::optional<double> scale = std::nullopt);
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin);

// ---- in-place (refuse tensors that autograd is tracking) ----------------------------------
const Tensor& copy_(const Tensor& dst, const Tensor& src);
const Tensor& fill_(const Tensor& x, double value);
const Tensor& zero_(const Tensor& x);

}  // namespace tessera
