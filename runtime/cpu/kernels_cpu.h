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

// The kernels every instruction-set copy defines.
#define TS_CPU_ISA_KERNELS                                                                       \
  void copy(const Tensor&, const Tensor&);                                                       \
  void fill(const Tensor&, double);                                                              \
  void unary(ops::UnaryOp, const Tensor&, const Tensor&);                                        \
  void unary_backward(ops::UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&); \
  void binary(ops::BinaryOp, const Tensor&, const Tensor&, const Tensor&);                       \
  void binary_scalar(ops::BinaryOp, const Tensor&, const Tensor&, double, bool);                 \
  void where(const Tensor&, const Tensor&, const Tensor&, const Tensor&);                        \
  void pointwise(PointwiseOp, const Tensor&, const Tensor&, const Tensor&, double);              \
  void clamp(const Tensor&, double, double);                                                     \
  void reduce(ReduceOp, const Tensor&, const Tensor&, int64_t, int64_t, int64_t);                \
  void argmax_rows(const Tensor&, const Tensor&, const Tensor&);                                 \
  void sum_squares(const Tensor&, const std::vector<Tensor>&);                                   \
  void adamw(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>&,  \
             const std::vector<Tensor>&, const ops::AdamWStep&);                                 \
  void softmax(const Tensor&, const Tensor&, bool);                                              \
  void softmax_backward(const Tensor&, const Tensor&, const Tensor&, bool);                       \
  void layer_norm(const ops::NormResult&, const Tensor&, const Tensor&, const Tensor&, double,   \
                  bool);                                                                         \
  void layer_norm_backward(const ops::NormGrads&, const Tensor&, const Tensor&, const Tensor&,   \
                           const Tensor&, const Tensor&, bool);                                  \
  void embedding(const Tensor&, const Tensor&, const Tensor&);                                   \
  void embedding_backward(const Tensor&, const Tensor&, const Tensor&);                          \
  void cross_entropy(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t);       \
  void cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,        \
                              const Tensor&, int64_t);                                           \
  void attention(const ops::AttentionResult&, const Tensor&, const Tensor&, const Tensor&, bool, \
                 double);                                                                        \
  void attention_backward(const ops::AttentionGrads&, const Tensor&, const Tensor&,              \
                          const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool,      \
                          double);                                                               \
  void rope(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);

namespace baseline {
TS_CPU_ISA_KERNELS
}
#if defined(TESSERA_CPU_ISA_VARIANTS)
namespace avx2 {
TS_CPU_ISA_KERNELS
}
namespace avx512 {
TS_CPU_ISA_KERNELS
}
#endif
#undef TS_CPU_ISA_KERNELS

// The kernel table of the instruction set in use (runtime/cpu/isa.h).
const KernelTable& table();

}  // namespace tessera::cpu
