// The CPU backend's kernels, one function per kernel-table entry (the tables
// in table.cpp; the asynchronous CPU test device queues the active table's).
//
// The vectorisable kernels (elementwise.cpp, reduce.cpp, nn.cpp,
// attention.cpp) are compiled once per instruction set, each copy into its own
// namespace (the build defines TS_CPU_ISA as baseline, avx2 or avx512; see
// meson.build), and table.cpp picks the widest the CPU has at run time
// (runtime/cpu/isa.h). So one binary runs on any x86-64 and uses AVX-512
// where it is there. GEMM (blas.cpp: oneDNN and OpenBLAS choose their own
// kernels) and the random fills are compiled once.
#pragma once

#include <algorithm>

#include "runtime/cpu/isa.h"
#include "runtime/kernels.h"
#include "runtime/parallel.h"

namespace tessera::cpu {

DType compute_dtype(KernelFamily family, DType dtype);
void gemm(DType, bool, bool, int64_t, int64_t, int64_t, double, const void*, int64_t,
          const void*, int64_t, double, void*, int64_t);
void uniform(const Tensor&, double, double, const RandomSpec&);
void normal(const Tensor&, double, double, const RandomSpec&);

// Attention's blocks (attention.cpp) and the scratch each thread takes from
// the allocator for them, in elements of the kernel's compute dtype (f32 for
// bf16/f16, which are `widened` into it): a planned step (meta.cpp) allocates
// as much as a run does.
constexpr int64_t kAttentionBq = 64;  // queries per block
constexpr int64_t kAttentionBk = 64;  // keys per block
// One block of scores, the output accumulator, running max and sum; widened,
// the Q, K and V blocks.
inline int64_t attention_scratch_per_thread(int64_t head_dim, bool widened) {
  return kAttentionBq * kAttentionBk + kAttentionBq * head_dim + 2 * kAttentionBq +
         (widened ? (kAttentionBq + 2 * kAttentionBk) * head_dim : 0);
}
// Two blocks (probabilities and their gradient) and a row of deltas per query;
// widened, one head's K, V, dK and dV (keys x head_dim each) and Q, dO and dQ
// (queries x head_dim each).
inline int64_t attention_backward_scratch_per_thread(int64_t queries, int64_t keys, int64_t head_dim,
                                                     bool widened) {
  return 2 * kAttentionBq * kAttentionBk + queries + (widened ? (4 * keys + 3 * queries) * head_dim : 0);
}

// The rows of scratch a kernel takes: one per thread that can have work (a
// parallel loop of n items with grain 1 runs on at most n threads, numbered
// from 0), not one per thread of the pool. A thread id beyond them (a loop
// run on one thread inside another team) wraps around: that call's scratch
// is its own.
inline int64_t attention_scratch_rows(int64_t work_items) {
  return std::max<int64_t>(1, std::min<int64_t>(num_threads(), work_items));
}

// Every kernel of runtime/op_list.h, declared in each instruction-set copy's
// namespace; the copies' tables (table.cpp) take each from there, so a kernel
// a copy lacks is a link error. GEMM and the random fills, compiled once
// (above), are reached through each copy's forwarders (elementwise.cpp).
#define TS_CPU_DECLARE(name, family, compute, params) void name params;
#define TS_CPU_NONE(name, family)
namespace baseline {
TESSERA_OPS(TS_CPU_DECLARE, TS_CPU_DECLARE, TS_CPU_NONE)
}
#if defined(TESSERA_CPU_ISA_VARIANTS)
namespace avx2 {
TESSERA_OPS(TS_CPU_DECLARE, TS_CPU_DECLARE, TS_CPU_NONE)
}
namespace avx512 {
TESSERA_OPS(TS_CPU_DECLARE, TS_CPU_DECLARE, TS_CPU_NONE)
}
#endif
#undef TS_CPU_DECLARE
#undef TS_CPU_NONE

// The kernel table of the instruction set in use (runtime/cpu/isa.h), and
// that of a given copy (null where this build has none).
const KernelTable& table();
const KernelTable* isa_table(Isa isa);

}  // namespace tessera::cpu
