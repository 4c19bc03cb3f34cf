// Numerical gradient checking: compares backward() against central
// differences in f64 on a random projection of the output.
#pragma once

#include <functional>
#include <string>

#include "runtime/tensor.h"

namespace tessera::autograd {

struct GradcheckResult {
  bool ok = true;
  double max_error = 0;  // largest |numeric - analytic| / (atol + rtol * |numeric|)
  std::string message;   // the worst element, for a failing test's output
};

// fn maps inputs to one tensor. Floating inputs must be f64; each becomes a
// leaf requiring grad. L = sum(fn(x) * w) with random w; dL/dx from backward()
// is compared with (L(x + eps) - L(x - eps)) / 2eps for every element.
GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn,
                          const TensorList& inputs, double eps = 1e-6, double atol = 1e-5,
                          double rtol = 1e-4, uint64_t seed = 1234);

}  // namespace tessera::autograd
