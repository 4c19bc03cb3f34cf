// The CPU backend's kernel table.
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <utility>

#include <oneapi/dnnl/dnnl.h>

#include "runtime/cpu/blas.h"
#include "runtime/cpu/isa.h"
#include "runtime/cpu/kernels_cpu.h"

namespace tessera {
namespace cpu {

// The elementwise, softmax, norm, cross-entropy, attention and RoPE kernels take
// bf16/f16 as they are (read into f32 registers, or widened a block at a time
// into per-thread scratch, rounded once on store: no f32 copy of the tensor;
// statistics in f32), and so do matrix products of bf16 where oneDNN has bf16
// kernels for this CPU (f32 accumulation, blas.cpp) or bf16gemm runs them on
// the own f32 kernel, which widens them as it packs them (the AVX2 copy:
// bf16_on_own_kernel). The other families
// (reductions, embedding gradients) compute in f32 (f64 for f64), but their
// kernels read bf16/f16 where they lie: sums and embedding gradients widen
// each element as they read it (sums_widen), argmax compares the values,
// sum_squares squares any floating dtype in f64.
DType compute_dtype(KernelFamily family, DType dtype) {
  if (family == KernelFamily::Elementwise || family == KernelFamily::Softmax || family == KernelFamily::Norm ||
      family == KernelFamily::CrossEntropy || family == KernelFamily::Attention || family == KernelFamily::Rope)
    return dtype;
  if (family == KernelFamily::Matmul && dtype == DType::BF16 && (bf16_gemm_native() || bf16_on_own_kernel()))
    return dtype;
  return tessera::compute_dtype(dtype);
}

namespace {

// The table of one instruction-set copy: every kernel of runtime/op_list.h
// from the copy's namespace (kernels_cpu.h declares them all there).
#define TS_CPU_TABLE(isa)                                                      \
  []() constexpr {                                                              \
    KernelTable t;                                                             \
    t.backend = "cpu";                                                         \
    t.compute_dtype = compute_dtype;                                           \
    t.strided_attention = true;                                                \
    t.sums_widen = true;                                                       \
    TESSERA_OPS(TS_CPU_ENTRY_##isa, TS_CPU_ENTRY_##isa, TS_CPU_SKIP)                               \
    return t;                                                                  \
  }()
#define TS_CPU_SKIP(name, family)
#define TS_CPU_ENTRY_baseline(name, family, compute, params) t.name = baseline::name;
constexpr KernelTable kBaseline = TS_CPU_TABLE(baseline);
#if defined(TESSERA_CPU_ISA_VARIANTS)
#define TS_CPU_ENTRY_avx2(name, family, compute, params) t.name = avx2::name;
#define TS_CPU_ENTRY_avx512(name, family, compute, params) t.name = avx512::name;
constexpr KernelTable kAvx2 = TS_CPU_TABLE(avx2);
constexpr KernelTable kAvx512 = TS_CPU_TABLE(avx512);
#endif

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

const KernelTable* isa_table(Isa isa) {
#if !defined(TESSERA_CPU_ISA_VARIANTS)
  if (isa != Isa::Baseline) return nullptr;
#endif
  return &table_of(isa);
}

}  // namespace cpu

}  // namespace tessera
