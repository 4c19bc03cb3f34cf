// This CPU's peak arithmetic rate, measured: a register-only loop of the
// widest multiply-add the kernels use, on several threads at once. The
// denominator of MFU (tessera-train, tessera-plan) and of bench_gemm's
// fractions. Units, by the products they bound:
//   Fma:     f32 fused multiply-add, AVX-512 where the kernels run their
//            avx512 copy (runtime/cpu/isa.h; TESSERA_CPU_ISA caps it), else
//            AVX2+FMA where the CPU has it (OpenBLAS's kernels, which no cap
//            reaches), else a scalar FMA loop (on other processors it
//            understates the vector units);
//   Bf16Dot: AVX512-BF16's vdpbf16ps (two bf16 products into each f32 lane);
//   Amx:     AMX's tdpbf16ps on full 16 x 32 tiles (bf16 in, f32 accumulators).
#pragma once

#include "runtime/dtype.h"

namespace tessera::cpu {

enum class PeakUnit { Fma, Bf16Dot, Amx };

struct Peak {
  double flops = 0;       // FLOP/s of all the threads together; 0 when the CPU lacks the unit
  const char* unit = "";  // e.g. "AVX-512 FMA"
};

// Whether this CPU (and, for AMX, the kernel) lets the unit run.
bool has_peak_unit(PeakUnit unit);
// The best of 3 rounds (about 0.03-0.05 s each on the machines measured: well
// inside the 0.5 s tessera-train's other ranks sleep) of the unit's loop on `threads`
// threads at once; {0, name} when the CPU lacks it.
Peak measure_peak(PeakUnit unit, int threads);
// The unit that runs products of `dtype` here: for bf16 oneDNN's (AMX where
// its kernels use the tiles, else AVX512-BF16; the f32 FMA where bf16
// products run on f32 copies, cpu::bf16_gemm_native()); the FMA for f32 (and
// f64, at half its rate: the loop is f32, so the figure is halved).
Peak measure_dtype_peak(DType dtype, int threads);

}  // namespace tessera::cpu
