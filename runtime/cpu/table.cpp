// The CPU backend's kernel table.
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <utility>

#include <oneapi/dnnl/dnnl.h>

#include "runtime/cpu/blas.h"
#include "runtime/cpu/isa.h"
#include "runtime/cpu/kernels_cpu.h"
#include "runtime/kernel_log.h"
#include "runtime/cuda_backend.h"

namespace tessera {
namespace cpu {

// The elementwise, softmax, norm, cross-entropy, attention and RoPE kernels take
// bf16/f16 as they are (read into f32 registers, or widened a block at a time
// into per-thread scratch, rounded once on store: no f32 copy of the tensor;
// statistics in f32), and so do matrix products of bf16 where oneDNN has bf16
// kernels for this CPU (f32 accumulation, blas.cpp); the other families
// (reductions, except sum_squares, which reads any floating dtype; embedding
// gradients) compute bf16/f16 on f32 copies the ops layer makes (and f64 in
// f64).
DType compute_dtype(KernelFamily family, DType dtype) {
  if (family == KernelFamily::Elementwise || family == KernelFamily::Softmax || family == KernelFamily::Norm ||
      family == KernelFamily::CrossEntropy || family == KernelFamily::Attention || family == KernelFamily::Rope)
    return dtype;
  if (family == KernelFamily::Matmul && dtype == DType::BF16 && bf16_gemm_native()) return dtype;
  return tessera::compute_dtype(dtype);
}

namespace {

// The table of one instruction-set copy of the kernels (GEMM and the random
// fills are compiled once: blas.cpp and random.cpp).
// clang-format off
#define TS_CPU_TABLE(isa) \
  KernelTable { \
    .compute_dtype = compute_dtype, \
    .copy = isa::copy, \
    .copy_from_host = isa::copy, \
    .copy_to_host = isa::copy, \
    .fill = isa::fill, \
    .unary = isa::unary, \
    .unary_backward = isa::unary_backward, \
    .binary = isa::binary, \
    .binary_scalar = isa::binary_scalar, \
    .where = isa::where, \
    .pointwise = isa::pointwise, \
    .clamp = isa::clamp, \
    .reduce = isa::reduce, \
    .argmax_rows = isa::argmax_rows, \
    .sum_squares = isa::sum_squares, \
    .gemm = gemm, \
    .adamw = isa::adamw, \
    .softmax = isa::softmax, \
    .softmax_backward = isa::softmax_backward, \
    .layer_norm = isa::layer_norm, \
    .layer_norm_backward = isa::layer_norm_backward, \
    .embedding = isa::embedding, \
    .embedding_backward = isa::embedding_backward, \
    .cross_entropy = isa::cross_entropy, \
    .cross_entropy_backward = isa::cross_entropy_backward, \
    .attention = isa::attention, \
    .attention_backward = isa::attention_backward, \
    .rope = isa::rope, \
    .uniform = uniform, \
    .normal = normal, \
  }
// clang-format on

const KernelTable kBaseline = TS_CPU_TABLE(baseline);
#if defined(TESSERA_CPU_ISA_VARIANTS)
const KernelTable kAvx2 = TS_CPU_TABLE(avx2);
const KernelTable kAvx512 = TS_CPU_TABLE(avx512);
#endif
#undef TS_CPU_TABLE

const KernelTable& table_of(Isa isa) {
#if defined(TESSERA_CPU_ISA_VARIANTS)
  if (isa == Isa::Avx512) return kAvx512;
  if (isa == Isa::Avx2) return kAvx2;
#endif
  (void)isa;
  return kBaseline;
}

// The widest copy the CPU runs, capped by TESSERA_CPU_ISA.
Isa default_isa() {
  Isa best = isa_supported(Isa::Avx512) ? Isa::Avx512
             : isa_supported(Isa::Avx2) ? Isa::Avx2
                                        : Isa::Baseline;
  const char* cap = std::getenv("TESSERA_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  Isa wanted = parse_isa(cap);
  if (static_cast<int>(wanted) >= static_cast<int>(best)) return best;
  // oneDNN's own kernels too, where it has not run yet (it takes a cap once).
  dnnl_set_max_cpu_isa(wanted == Isa::Avx2 ? dnnl_cpu_isa_avx2 : dnnl_cpu_isa_sse41);
  return wanted;
}

std::atomic<Isa>& active() {
  static std::atomic<Isa> isa{default_isa()};
  return isa;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Baseline: return "baseline";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

Isa parse_isa(std::string_view name) {
  for (Isa isa : {Isa::Baseline, Isa::Avx2, Isa::Avx512})
    if (name == isa_name(isa)) return isa;
  TS_CHECK(false, "TESSERA_CPU_ISA: expected baseline, avx2 or avx512, got '{}'", name);
}

bool isa_supported(Isa isa) {
  if (isa == Isa::Baseline) return true;
#if defined(TESSERA_CPU_ISA_VARIANTS)
  // The levels the copies are compiled for (-march=x86-64-v3 / -v4: AVX2, FMA,
  // F16C, BMI1/2, LZCNT, MOVBE; then AVX-512 F, BW, CD, DQ, VL). May run
  // before main (from static constructors), hence __builtin_cpu_init.
  static const bool v3 = (__builtin_cpu_init(), __builtin_cpu_supports("x86-64-v3"));
  static const bool v4 = v3 && __builtin_cpu_supports("x86-64-v4");
  return isa == Isa::Avx2 ? v3 : v4;
#else
  return false;
#endif
}

Isa active_isa() { return active().load(); }

Isa set_isa(Isa isa) {
  TS_CHECK(isa_supported(isa), "set_isa: this {} cannot run the {} kernels",
           isa == Isa::Baseline ? "build" : "CPU or build", isa_name(isa));
  return active().exchange(isa);
}

const KernelTable& table() { return table_of(active().load(std::memory_order_relaxed)); }

}  // namespace cpu

namespace {
void (*op_boundary_hook)() = nullptr;
// Tables a test installed, by DeviceType.
const KernelTable* replaced[4] = {};
}  // namespace

const KernelTable* replace_kernels_for_testing(DeviceType type, const KernelTable* table) {
  return std::exchange(replaced[static_cast<int>(type)], table);
}

const KernelTable& kernels(Device device) {
  if (const KernelTable* t = replaced[static_cast<int>(device.type)]) return *t;
  if (device.is_cpu()) return cpu::table();
  if (device.type == DeviceType::AsyncCPU) return async_cpu::kTable;
  if (device.is_meta()) return meta_kernels::kTable;  // runs nothing; logs while recording
  if (device.is_cuda()) return cuda::kernel_table();
  TS_CHECK(false, "no kernels for device {}", device.str());
}

void set_op_boundary_hook(void (*hook)()) { op_boundary_hook = hook; }

const KernelTable& dispatch(Device device) {
  if (op_boundary_hook != nullptr) op_boundary_hook();
  return kernels(device);
}

}  // namespace tessera
