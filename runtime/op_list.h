// Every op Tessera has, declared once (in the spirit of ggml's op list and
// PyTorch's native_functions.yaml). Each row is one op:
//
//   KERNEL(name, family, compute, (params))      an op with a kernel-table entry
//                                                of its own: `name`, taking
//                                                `params`, on every backend
//   CPU_KERNEL(name, family, compute, (params))  the same, with kernels on the
//                                                CPU's backends only (cpu, meta,
//                                                async_cpu): the CUDA table says
//                                                it lacks them, and the op runs a
//                                                composite there or fails naming
//                                                the op and the device
//   OP(name, family)                             an op built on other ops' kernels
//                                                (linear on gemm) or on none (views)
//
// family   what the op is (OpFamily): how a tensor subclass's layer finds
//          its rule for the op (it registers one per op id, a file per
//          family), or Kernel: a kernel only, never seen by a subclass
//          (the copies, fills and updates the ops above are built from)
// compute  the KernelFamily whose compute dtype the kernel receives its float
//          inputs in (each backend declares its dtypes per family)
//
// From this list come: the op ids and their names (runtime/op_call.h), the
// kernel table type and its checked calls (runtime/kernels.h), the CPU's
// per-instruction-set kernel declarations and tables (runtime/cpu/), the
// meta device's logging table, the asynchronous test device's queueing table,
// and a test that every backend has every kernel (tests/runtime/test_ops.cpp).
// Adding an op: docs/adding-an-op.md.
//
// The kernels' contract (what runtime/ops.h hands them): every kernel is
// enqueued on its device's current stream (on the CPU it runs before the call
// returns, elsewhere later), so none returns a value to the host; float
// inputs arrive in the table's compute dtype for the kernel's family; 2-D
// kernels take contiguous row-major tensors unless the row says otherwise.
#pragma once

// clang-format off
#define TESSERA_OPS(KERNEL, CPU_KERNEL, OP)                                                                            \
  /* ---- copies and fills ---- */                                                                              \
  /* same shape, any strides, any dtypes (converting) */                                                        \
  KERNEL(copy, Kernel, Elementwise, (const Tensor& dst, const Tensor& src))                                     \
  /* between the device and host memory: the Device::cpu() side (src of copy_from_host, dst of copy_to_host)    \
     is kept alive until the copy ran; the caller synchronizes before the host reads a copy_to_host result */   \
  KERNEL(copy_from_host, Kernel, Elementwise, (const Tensor& dst, const Tensor& src))                           \
  KERNEL(copy_to_host, Kernel, Elementwise, (const Tensor& dst, const Tensor& src))                             \
  KERNEL(fill, Kernel, Elementwise, (const Tensor& dst, double value))                                          \
  /* ---- elementwise: out and x share a float dtype; out contiguous ---- */                                    \
  KERNEL(unary, Pointwise, Elementwise, (ops::UnaryOp op, const Tensor& out, const Tensor& x))                  \
  KERNEL(unary_backward, Pointwise, Elementwise,                                                                \
         (ops::UnaryOp op, const Tensor& gx, const Tensor& gy, const Tensor& x, const Tensor& y))               \
  /* a, b expanded to out's shape (any strides); out may alias a; bool out for comparisons */                   \
  KERNEL(binary, Pointwise, Elementwise, (ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b)) \
  KERNEL(binary_scalar, Kernel, Elementwise,                                                                    \
         (ops::BinaryOp op, const Tensor& out, const Tensor& a, double s, bool scalar_first))                   \
  KERNEL(where, Pointwise, Elementwise, (const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b)) \
  /* in place on x (any strides); a, b expanded to x's shape; b unused for AddScaled/Lerp */                    \
  KERNEL(pointwise, Kernel, Elementwise, (PointwiseOp op, const Tensor& x, const Tensor& a, const Tensor& b, double s)) \
  KERNEL(clamp, Kernel, Elementwise, (const Tensor& x, double lo, double hi))                                   \
  /* Llama's MLP gate: out = silu(gate) * up, the bits of silu then mul in every dtype (silu(gate) rounded   \
     to it first); gate, up and out of one shape, contiguous. Its backward: dgate and dup from grad */          \
  CPU_KERNEL(swiglu, Pointwise, Elementwise, (const Tensor& out, const Tensor& gate, const Tensor& up))         \
  CPU_KERNEL(swiglu_backward, Pointwise, Elementwise,                                                           \
         (const Tensor& dgate, const Tensor& dup, const Tensor& grad, const Tensor& gate, const Tensor& up))    \
  /* GPT-2's MLP activation after c_fc's bias: out = gelu(x + bias) (tanh_approx: GELU's tanh form),            \
     the bits of add then gelu in every dtype (x + bias rounded to it first); x and out [rows, n],              \
     bias [n], contiguous. Its backward: gx = gelu'(x + bias) * grad, and gbias its sum over the rows           \
     in reduce's order and output dtype */                                                                      \
  CPU_KERNEL(bias_gelu, Pointwise, Elementwise,                                                                 \
             (const Tensor& out, const Tensor& x, const Tensor& bias, bool tanh_approx))                        \
  CPU_KERNEL(bias_gelu_backward, Pointwise, Elementwise,                                                        \
             (const Tensor& gx, const Tensor& gbias, const Tensor& grad, const Tensor& x, const Tensor& bias,   \
              bool tanh_approx))                                                                                \
  OP(copy_, InPlace) OP(fill_, InPlace) OP(add_, InPlace) OP(mul_, InPlace) OP(div_, InPlace)                   \
  OP(addcmul_, InPlace) OP(addcdiv_, InPlace) OP(lerp_, InPlace) OP(sqrt_, InPlace) OP(clamp_, InPlace)         \
  /* ---- reductions ---- */                                                                                    \
  /* x contiguous viewed as [outer, n, inner]; out [outer, inner] (Sum accumulates in f64); bf16/f16 x          \
     reduce into an f32 out on a table with sums_widen (runtime/kernels.h), into their dtype elsewhere */       \
  KERNEL(reduce, Kernel, Reduction,                                                                             \
         (ReduceOp op, const Tensor& out, const Tensor& x, int64_t outer, int64_t n, int64_t inner))            \
  /* x contiguous [rows, n], any dtype -> values [rows] in x's dtype, i64 indices [rows] (the first maximum;    \
     NaN is the maximum); bf16/f16 compared as their values, no copy */                                         \
  KERNEL(argmax_rows, Kernel, Reduction, (const Tensor& values, const Tensor& indices, const Tensor& x))         \
  /* out (one f64 element) = the sum of every x's squared elements (each contiguous, any floating dtype,        \
     squared in f64): one pass over many tensors, e.g. all gradients */                                         \
  KERNEL(sum_squares, Reduction, Reduction, (const Tensor& out, const std::vector<Tensor>& xs))                 \
  OP(sum, Reduction) OP(var, Reduction) OP(max, Reduction) OP(argmax, Reduction)                                \
  /* ---- matrix products ---- */                                                                               \
  /* C = alpha * op(A) op(B) + beta * C; row-major; A, B and C in `dtype`, a compute dtype of Matmul */         \
  KERNEL(gemm, Kernel, Matmul,                                                                                  \
         (DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void* a, \
          int64_t lda, const void* b, int64_t ldb, double beta, void* c, int64_t ldc))                          \
  OP(matmul, Matrix) OP(linear, Matrix) OP(linear_backward, Matrix) OP(gemm_into, Matrix)                       \
  /* ---- the optimizer: AdamW on every (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]), each contiguous,    \
     of one float dtype (bf16/f16 computed in f32) ---- */                                                      \
  KERNEL(adamw, Kernel, Elementwise,                                                                            \
         (const std::vector<Tensor>& params, const std::vector<Tensor>& grads,                                  \
          const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,                          \
          const ops::AdamWStep& step))                                                                          \
  /* every xs[i] (contiguous, float, any mix of dtypes) times coef, a 0-dim f64 tensor on the device, computed   \
     in f32 (f64 for f64 tensors) and rounded once, as mul_ by a scalar: one pass over many tensors, the         \
     coefficient never read by the host (clip_grad_norm_) */                                                    \
  KERNEL(scale, Kernel, Elementwise, (const std::vector<Tensor>& xs, const Tensor& coef))                       \
  /* ---- softmax, attention, RoPE: rows of the last dim, contiguous ---- */                                    \
  KERNEL(softmax, Attention, Softmax, (const Tensor& out, const Tensor& x, bool log))                            \
  KERNEL(softmax_backward, Attention, Softmax, (const Tensor& gx, const Tensor& gy, const Tensor& y, bool log))  \
  OP(log_softmax, Attention) OP(log_softmax_backward, Attention)                                                \
  /* q, k, v, dout, out [B, H, T, D]: contiguous, or (a table with strided_attention) unit stride along D and    \
     any other strides, as are the outputs it is handed (runtime/kernels.h) */                                  \
  KERNEL(attention, Attention, Attention,                                                                       \
         (const ops::AttentionResult& r, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,        \
          double scale))                                                                                        \
  KERNEL(attention_backward, Attention, Attention,                                                              \
         (const ops::AttentionGrads& g, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,  \
          const Tensor& out, const Tensor& lse, bool causal, double scale))                                     \
  /* out and x [..., t, d] contiguous; cos, sin [t, d / 2] in x's statistics dtype (f32 for bf16/f16 x) */      \
  KERNEL(rope, Attention, Rope,                                                                                 \
         (const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse))              \
  /* ---- norms ---- */                                                                                         \
  KERNEL(layer_norm, Norm, Norm,                                                                                \
         (const ops::NormResult& r, const Tensor& x, const Tensor& w, const Tensor& b, double eps, bool rms))    \
  KERNEL(layer_norm_backward, Norm, Norm,                                                                       \
         (const ops::NormGrads& g, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,      \
          const Tensor& rstd, bool rms))                                                                        \
  OP(rms_norm, Norm) OP(rms_norm_backward, Norm)                                                                \
  /* a pre-norm block's residual step: sum = x + residual (rounded to x's dtype, as add rounds it), then r =    \
     the norm of sum, as layer_norm gives it, each row normalised while it is in cache; x, residual and sum     \
     of one shape and dtype. DTensors never reach it: on them it is add, then the norm (runtime/ops_nn.cpp) */  \
  CPU_KERNEL(add_layer_norm, Kernel, Norm,                                                                      \
             (const ops::NormResult& r, const Tensor& sum, const Tensor& x, const Tensor& residual,             \
              const Tensor& w, const Tensor& b, double eps, bool rms))                                          \
  /* ---- embedding and loss ---- */                                                                            \
  KERNEL(embedding, EmbeddingLoss, Embedding, (const Tensor& out, const Tensor& weight, const Tensor& indices))  \
  /* gw [num, d] (zeroed, f32 or f64) += grad's rows [count, d] at their indices: grad in gw's dtype, or        \
     bf16/f16 into an f32 gw on a table with sums_widen (runtime/kernels.h) */                                  \
  KERNEL(embedding_backward, EmbeddingLoss, Embedding,                                                          \
         (const Tensor& gw, const Tensor& grad, const Tensor& indices))                                         \
  KERNEL(cross_entropy, EmbeddingLoss, CrossEntropy,                                                            \
         (const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& target,                  \
          int64_t ignore_index))                                                                                \
  /* scale: a 0-dim f64 tensor (d loss / d mean, over the counted targets) */                                   \
  KERNEL(cross_entropy_backward, EmbeddingLoss, CrossEntropy,                                                   \
         (const Tensor& glogits, const Tensor& scale, const Tensor& logits, const Tensor& target,               \
          const Tensor& lse, int64_t ignore_index))                                                             \
  /* ---- random fills (runtime/random.h); x contiguous float ---- */                                           \
  KERNEL(uniform, Kernel, Random, (const Tensor& x, double low, double high, const RandomSpec& spec))           \
  KERNEL(normal, Kernel, Random, (const Tensor& x, double mean, double std, const RandomSpec& spec))            \
  OP(uniform_, Random) OP(normal_, Random)                                                                      \
  /* ---- views and layouts ---- */                                                                             \
  OP(view, View) OP(reshape, View) OP(permute, View) OP(transpose, View) OP(cat, View) OP(stack, View)          \
  /* a view by strides (narrow, select, expand, squeeze, as_strided, ...): no subclass takes one */            \
  OP(strided_view, View)                                                                                        \
  /* a new tensor laid out as its input: contiguous, clone, to(dtype), to(device), zeros_like, ... */           \
  OP(contiguous, Like) OP(clone, Like) OP(to_dtype, Like) OP(to_device, Like) OP(zeros_like, Like)              \
  OP(empty_like, Like) OP(detach, Like)                                                                         \
  /* a gradient laid out as its parameter, as it accumulates (autograd/tape.cpp) */                             \
  OP(gradient_layout, View)
// clang-format on
