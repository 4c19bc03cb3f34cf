// What a CUDA kernel knows of a tensor: a pointer, a dtype and up to kMaxDims
// sizes and strides (in elements), passed by value. Plain data, so that the
// .cu files include neither Tensor nor fmt (nvcc compiles them quickly and
// with the host compiler's warnings as errors).
#pragma once

#include <cstdint>

#include "runtime/dtype.h"

namespace tessera::cuda {

constexpr int kMaxDims = 8;

struct TensorArg {
  void* data = nullptr;
  DType dtype = DType::F32;
  int ndim = 0;
  bool contiguous = true;  // row-major with no gaps: element i is at data[i]
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

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
