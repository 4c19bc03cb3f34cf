// What the cuda suite's files share: the device, tolerances per dtype, and
// a comparison against the CPU after a copy to the host.
#pragma once

#include <cmath>

#include "../helpers.h"
#include "nn/transformer.h"
#include "runtime/ops.h"

namespace tessera::cuda_testing {

inline const Device kGpu = Device::cuda(0);

// Tolerance per dtype: relative to the largest magnitude of the reference.
inline double tolerance(DType dt) {
  switch (dt) {
    case DType::F64: return 1e-12;
    case DType::F32: return 2e-5;
    case DType::F16: return 2e-3;
    default: return 1.6e-2;  // bf16: 8 bits of mantissa
  }
}

// max |a - b| / max(1, max |b|) over the elements, after a copy to the host in f64.
inline double rel_error(const Tensor& gpu, const Tensor& cpu) {
  auto a = ops::to(gpu.to(Device::cpu()), DType::F64).to_vector<double>();
  auto b = ops::to(cpu, DType::F64).to_vector<double>();
  REQUIRE(a.size() == b.size());
  double scale = 1, err = 0;
  for (double v : b) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::isinf(b[i]) && a[i] == b[i]) continue;
    err = std::max(err, std::fabs(a[i] - b[i]));
  }
  return err / scale;
}

#define CHECK_MATCHES_CPU(gpu, cpu, dt)                                  \
  do {                                                             \
    INFO(#gpu << " in " << dtype_name(dt));                        \
    CHECK((gpu).device() == kGpu);                                 \
    CHECK((gpu).dtype() == (cpu).dtype());                         \
    CHECK((gpu).shape() == (cpu).shape());                         \
    CHECK(rel_error(gpu, cpu) <= tolerance(dt));                   \
  } while (0)

inline Tensor rand_on(Shape shape, uint64_t seed, DType dt, Device d) {
  return ops::to(randn(std::move(shape), seed, DType::F32, d), dt);
}

inline const DType kFloats[] = {DType::F32, DType::BF16, DType::F16, DType::F64};

// Two blocks, 4 heads of 12, a vocabulary of 97: odd sizes, quick.
inline nn::TransformerConfig tiny_config() {
  nn::TransformerConfig cfg;
  cfg.vocab_size = 97;
  cfg.block_size = 32;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 48;
  return cfg;
}


}  // namespace tessera::cuda_testing
