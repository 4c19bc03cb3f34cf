// How a CUDA kernel sees its operands: N of one shape (inputs expanded to it,
// stride 0 where broadcast), dims coalesced on the host, passed by value.
// Plain data and host/device code only (no Tensor, no CUDA headers), so the
// CPU tests check the indexing (tests/runtime/test_cuda_iter.cpp) and the .cu
// files compile quickly with the host compiler's warnings as errors.
#pragma once

#include <cstdint>

#include "runtime/dtype.h"
#include "runtime/math.h"

namespace tessera::cuda {

constexpr int kMaxDims = 8;

// Operand 0 is the output.
template <int N>
struct Iter {
  int ndim = 0;
  int64_t numel = 0;
  bool contiguous = true;  // every operand dense in the same order: offset = index
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};  // elements
  void* data[N] = {};
  DType dtype[N] = {};
};

// Element offset of operand k at row-major index i of the (coalesced) shape.
template <int N>
TS_HD TS_INLINE int64_t offset_of(const Iter<N>& it, int k, int64_t i) {
  if (it.contiguous) return i;
  int64_t off = 0;
  for (int d = it.ndim - 1; d >= 0; --d) {
    int64_t size = it.sizes[d];
    off += (i % size) * it.strides[k][d];
    i /= size;
  }
  return off;
}

// Where an index error found on the device is recorded, to be raised at the
// next synchronize naming the kernel (runtime/cuda/common.h).
struct DeviceError {
  int code;         // 0: none; 1: index out of range
  int kernel;       // which kernel (KernelId)
  long long value;  // the offending index
  long long limit;  // the valid range's end
};

enum class KernelId : int { None, Embedding, EmbeddingBackward, CrossEntropy, CrossEntropyBackward };

}  // namespace tessera::cuda
