// The kinds of operations the kernel tables implement: plain enums that both
// the host code and the CUDA kernels include (no tensors, no fmt here).
#pragma once

#include <cstdint>

#include "runtime/op_list.h"

namespace tessera {

// What an op is (runtime/op_list.h's family column): a tensor subclass's layer
// finds the rule it handles the op by from it. Kernel: a kernel only,
// which no subclass sees (the copies, fills and updates ops are built from).
enum class OpFamily : uint8_t {
  Kernel, Pointwise, InPlace, Reduction, Matrix, Attention, Norm, EmbeddingLoss, Random, View, Like
};

// Every op of runtime/op_list.h, in its order.
enum class OpId : uint16_t {
#define TS_OP_ID(name, ...) name,
  TESSERA_OPS(TS_OP_ID, TS_OP_ID, TS_OP_ID)
#undef TS_OP_ID
};

namespace detail {
#define TS_OP_COUNT(...) +1
inline constexpr int kNumOps = 0 TESSERA_OPS(TS_OP_COUNT, TS_OP_COUNT, TS_OP_COUNT);
#undef TS_OP_COUNT
#define TS_OP_NAME(name, ...) #name,
inline constexpr const char* kOpNames[] = {TESSERA_OPS(TS_OP_NAME, TS_OP_NAME, TS_OP_NAME)};
#undef TS_OP_NAME
#define TS_OP_FAMILY(name, family, ...) OpFamily::family,
inline constexpr OpFamily kOpFamilies[] = {TESSERA_OPS(TS_OP_FAMILY, TS_OP_FAMILY, TS_OP_FAMILY)};
#undef TS_OP_FAMILY
#define TS_KERNEL_YES(...) true,
#define TS_KERNEL_NO(...) false,
inline constexpr bool kOpHasKernel[] = {TESSERA_OPS(TS_KERNEL_YES, TS_KERNEL_YES, TS_KERNEL_NO)};
inline constexpr bool kOpCpuOnly[] = {TESSERA_OPS(TS_KERNEL_NO, TS_KERNEL_YES, TS_KERNEL_NO)};
#undef TS_KERNEL_YES
#undef TS_KERNEL_NO
}  // namespace detail

inline constexpr int kNumOps = detail::kNumOps;
// The op's name as the list spells it ("rope", "layer_norm_backward").
constexpr const char* op_name(OpId op) { return detail::kOpNames[static_cast<int>(op)]; }
constexpr OpFamily op_family(OpId op) { return detail::kOpFamilies[static_cast<int>(op)]; }
// Whether the op has a kernel-table entry of its own (a KERNEL row).
constexpr bool op_has_kernel(OpId op) { return detail::kOpHasKernel[static_cast<int>(op)]; }
// Whether its kernel is on the CPU's backends only (a CPU_KERNEL row).
constexpr bool op_cpu_only(OpId op) { return detail::kOpCpuOnly[static_cast<int>(op)]; }

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
