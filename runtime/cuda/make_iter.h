// Tensors to an Iter (runtime/cuda/iter.h): size-1 dims dropped, neighbouring
// dims merged where every operand is dense across them (as the CPU's
// StridedLoop does). Host code without CUDA headers, so the CPU tests use it.
#pragma once

#include <array>

#include "runtime/check.h"
#include "runtime/cuda/iter.h"
#include "runtime/tensor.h"

namespace tessera::cuda {

template <int N>
Iter<N> make_iter(const Shape& shape, const std::array<const Tensor*, N>& operands) {
  Iter<N> it;
  it.numel = shape_numel(shape);
  for (int k = 0; k < N; ++k) {
    it.data[k] = it.numel == 0 ? nullptr : operands[k]->data_ptr();
    it.dtype[k] = operands[k]->dtype();
  }
  int nd = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = nd > 0;
    for (int k = 0; k < N && merge; ++k)
      merge = it.strides[k][nd - 1] == operands[k]->strides()[d] * shape[d];
    if (merge) {
      it.sizes[nd - 1] *= shape[d];
      for (int k = 0; k < N; ++k) it.strides[k][nd - 1] = operands[k]->strides()[d];
      continue;
    }
    TS_CHECK(nd < kMaxDims, "CUDA kernels take at most {} non-mergeable dims; got shape {}", kMaxDims,
             shape_str(shape));
    it.sizes[nd] = shape[d];
    for (int k = 0; k < N; ++k) it.strides[k][nd] = operands[k]->strides()[d];
    ++nd;
  }
  it.ndim = nd;
  it.contiguous = nd == 0;
  if (nd == 1) {
    it.contiguous = true;
    for (int k = 0; k < N; ++k) it.contiguous = it.contiguous && it.strides[k][0] == 1;
  }
  return it;
}

}  // namespace tessera::cuda
