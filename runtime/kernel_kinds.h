// The kernel tables' own operation kinds (runtime/kernels.h): plain enums the
// CUDA kernels include too. Kept out of runtime/ops.h, so that user code that
// names dist::ReduceOp is not made ambiguous.
#pragma once

#include "runtime/op_kinds.h"

namespace tessera {

enum class PointwiseOp {
  AddScaled,  // x += s * a
  Addcmul,    // x += s * a * b
  Addcdiv,    // x += s * a / b
  Lerp,       // x += s * (a - x)
};

enum class ReduceOp { Sum, Max, Min };

}  // namespace tessera
