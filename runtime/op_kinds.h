// The kinds of operations the kernel tables implement: plain enums that both
// the host code and the CUDA kernels include (no tensors, no fmt here).
#pragma once

#include <cstdint>

namespace tessera {

// The families of float kernels a backend declares its dtypes for: each
// family's kernels receive their float inputs in one dtype per input dtype.
enum class KernelFamily : uint8_t {
  Elementwise,   // unary, binary, in-place updates (pointwise, clamp)
  Reduction,     // sum, mean, var, max/argmax, sum_squares
  Matmul,        // gemm: matmul, linear, gemm_into
  Softmax,       // softmax, log_softmax and their backward
  Norm,          // layer_norm, rms_norm and their backward
  Embedding,     // embedding backward (the forward copies rows in the weight's dtype)
  CrossEntropy,  // fused cross-entropy forward and backward
  Attention,     // fused attention forward and backward
  Rope,          // rotary embedding
  Random,        // uniform / normal fills
};

}  // namespace tessera

namespace tessera::ops {

enum class UnaryOp {
  Neg, Exp, Log, Sqrt, Rsqrt, Abs, Tanh, Sigmoid, Relu, Gelu, GeluTanh, Silu, Sin, Cos,
  Square, Reciprocal, Sign
};

enum class BinaryOp { Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge };

// One AdamW update's settings (ops::adamw_, runtime/math.h's adamw_update).
struct AdamWStep {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1 for the first update: the bias corrections use it
};

}  // namespace tessera::ops
