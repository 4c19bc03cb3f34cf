// What the cuda suite's files share: the device, tolerances per dtype, and
// a comparison against the CPU after a copy to the host.
#pragma once

#include <cmath>

#include "../helpers.h"
#include "nn/transformer.h"
#include "runtime/ops.h"

namespace tessera::cuda_testing {

#if defined(TESSERA_CUDA_SUITE_STAND_IN)
// The suite's own logic on the async_cpu test device (test `cuda-logic`, on
// every machine): the same tests with async_cpu, a queued device that runs
// the CPU's kernels, in the GPU's place. It proves nothing about CUDA; it
// catches what breaks the tests themselves (shapes, tapes, loops, the FSDP
// and checkpoint plumbing) long before a GPU is lent to run them.
inline constexpr bool kStandIn = true;
inline const Device kGpu = Device::async_cpu();
inline const char* const kGpuMesh = "async_cpu";
#else
inline constexpr bool kStandIn = false;
inline const Device kGpu = Device::cuda(0);
inline const char* const kGpuMesh = "cuda";
#endif

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

// The GPU's result against the CPU's: device, dtype, shape, and within `tol`.
#define CHECK_MATCHES_CPU_WITHIN(gpu, cpu, dt, tol)                    \
  do {                                                             \
    INFO(#gpu << " in " << dtype_name(dt));                        \
    CHECK((gpu).device() == kGpu);                                 \
    CHECK((gpu).dtype() == (cpu).dtype());                         \
    CHECK((gpu).shape() == (cpu).shape());                         \
    CHECK(rel_error(gpu, cpu) <= (tol));                           \
  } while (0)
#define CHECK_MATCHES_CPU(gpu, cpu, dt) CHECK_MATCHES_CPU_WITHIN(gpu, cpu, dt, tolerance(dt))

// Attention's gradients in bf16/f16 where cuDNN may run them: its flash
// backward rounds the probabilities and their gradient (P and dS) to the
// input dtype for the tensor-core products (dV = P^T dO, dQ = dS K,
// dK = dS^T Q), which the CPU's reference keeps in f32; twice the dtype's
// tolerance. Measured on an H200: dq in f16 2.1e-3 of its largest element.
inline double attention_grad_tolerance(DType dt) {
  return dt == DType::F16 || dt == DType::BF16 ? 2 * tolerance(dt) : tolerance(dt);
}

#define CHECK_ATTENTION_GRAD_MATCHES_CPU(gpu, cpu, dt) \
  CHECK_MATCHES_CPU_WITHIN(gpu, cpu, dt, attention_grad_tolerance(dt))

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
