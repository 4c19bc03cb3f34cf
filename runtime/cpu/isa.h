// Which instruction-set copy of the CPU kernels runs (runtime/cpu/kernels_cpu.h).
// By default the widest the CPU supports. TESSERA_CPU_ISA=baseline|avx2|avx512
// lowers that default for a process, and oneDNN's GEMM kernels with it (as its
// own DNNL_MAX_CPU_ISA does). set_isa switches Tessera's kernels (and the
// library choice for f32 products) at run time to any copy the CPU runs, for
// tests and benchmarks that compare the copies; oneDNN keeps its kernels.
//   baseline: x86-64 (SSE2), or the build's own flags on other processors
//   avx2:     x86-64-v3 (AVX2, FMA, F16C)
//   avx512:   x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), 512-bit vectors
#pragma once

#include <string_view>

namespace tessera::cpu {

enum class Isa { Baseline, Avx2, Avx512 };

const char* isa_name(Isa isa);
// Parses "baseline", "avx2" or "avx512"; anything else throws, naming them.
Isa parse_isa(std::string_view name);
// Whether this CPU can run the copy, and this build has it.
bool isa_supported(Isa isa);
// The copy in use; set_isa refuses one the CPU cannot run and returns the previous one.
Isa active_isa();
Isa set_isa(Isa isa);

}  // namespace tessera::cpu
