// What a cuBLASLt GEMM plan depends on (internal to runtime/cuda/; host C++
// with no CUDA header, so the CPU tests check it).
//
// A plan (descriptors, layouts, the heuristic's algorithm) is cached per key.
// The heuristic may pick an algorithm that needs 16-byte (or wider) operands,
// so the key carries each operand's alignment and the plan tells cuBLASLt
// (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES): a batched product's slices
// at odd offsets, or a narrowed view, then get a plan of their own instead of
// an algorithm that reads out of line.
#pragma once

#include <compare>
#include <cstdint>

#include "runtime/dtype.h"

namespace tessera::cuda {

// The cap cuBLASLt asks for at most (its default assumption).
constexpr int kMaxGemmAlignment = 256;

// The largest power of two dividing the address, capped at kMaxGemmAlignment
// (the cap for null).
inline int pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (a == 0) return kMaxGemmAlignment;
  const std::uintptr_t low = a & (~a + 1);  // the lowest set bit
  return low >= static_cast<std::uintptr_t>(kMaxGemmAlignment) ? kMaxGemmAlignment : static_cast<int>(low);
}

struct GemmKey {
  DType dtype;
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  bool tf32;
  int align_a, align_b, align_c;  // bytes, pointer_alignment of each operand
  auto operator<=>(const GemmKey&) const = default;
};

inline GemmKey gemm_key(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                        int64_t lda, const void* b, int64_t ldb, const void* c, int64_t ldc, bool tf32) {
  return {dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, tf32,
          pointer_alignment(a), pointer_alignment(b), pointer_alignment(c)};
}

}  // namespace tessera::cuda
