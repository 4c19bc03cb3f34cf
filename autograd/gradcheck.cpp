#include "autograd/gradcheck.h"

#include <cmath>

#include "autograd/functions.h"

namespace tessera::autograd {

GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn,
                          const TensorList& inputs, double eps, double atol, double rtol,
                          uint64_t seed) {
  TensorList leaves;
  for (const Tensor& x : inputs) {
    if (!x.defined() || !is_floating(x.dtype())) {
      leaves.push_back(x);
      continue;
    }
    TS_CHECK(x.dtype() == DType::F64, "gradcheck: floating inputs must be f64, got {}",
             dtype_name(x.dtype()));
    Tensor leaf = ops::clone(x);
    leaf.set_requires_grad(true);
    leaves.push_back(leaf);
  }

  Tensor y = fn(leaves);
  Tensor w = randn(y.shape(), seed, DType::F64);
  auto projected = [&](const TensorList& xs) {
    NoGradGuard no_grad;
    return ops::sum(ops::mul(fn(xs), w)).item();
  };
  backward(sum(mul(y, w)));

  GradcheckResult result;
  for (size_t i = 0; i < leaves.size(); ++i) {
    Tensor& x = leaves[i];
    if (!x.defined() || !x.requires_grad()) continue;
    Tensor analytic = x.grad().defined() ? x.grad() : zeros_like(x);
    std::vector<double> ana = analytic.to_vector<double>();
    double* p = x.data<double>();
    for (int64_t e = 0; e < x.numel(); ++e) {
      double orig = p[e];
      p[e] = orig + eps;
      double up = projected(leaves);
      p[e] = orig - eps;
      double down = projected(leaves);
      p[e] = orig;
      double numeric = (up - down) / (2 * eps);
      double err = std::fabs(numeric - ana[static_cast<size_t>(e)]) / (atol + rtol * std::fabs(numeric));
      if (!(err <= result.max_error)) {
        result.max_error = err;
        result.message = fmt::format("input {} element {}: numeric {:.9g} vs analytic {:.9g}", i,
                                     e, numeric, ana[static_cast<size_t>(e)]);
      }
    }
  }
  result.ok = result.max_error <= 1.0;
  return result;
}

}  // namespace tessera::autograd
