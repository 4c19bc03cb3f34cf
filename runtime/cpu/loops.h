// Strided iteration for CPU kernels: N operands of one shape (broadcast inputs
// carry stride 0), dims coalesced where all operands allow, the outer index
// space split across threads, and the innermost run handed to a callback with
// byte strides so the common contiguous case is a plain vectorisable loop.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "runtime/cpu/isa_copy.h"
#include "runtime/parallel_for.h"
#include "runtime/tensor.h"

// In each kernel copy's namespace: a class shared by the copies would be one
// symbol, compiled for whichever instruction set the linker happened to keep.
namespace tessera::cpu::TS_CPU_ISA {

template <int N>
class StridedLoop {
 public:
  // operands[0] is usually the output; all must have `shape` (inputs expanded).
  StridedLoop(const Shape& shape, const std::array<const Tensor*, N>& operands) {
    int nd = static_cast<int>(shape.size());
    for (int k = 0; k < N; ++k) {
      base_[k] = operands[k]->numel() == 0 ? nullptr : static_cast<char*>(operands[k]->data_ptr());
      elsize_[k] = static_cast<int64_t>(dtype_size(operands[k]->dtype()));
    }
    // Drop size-1 dims, then merge dim i into i+1 when every operand is contiguous across them.
    for (int d = 0; d < nd; ++d) {
      if (shape[d] == 1) continue;
      std::array<int64_t, N> st;
      for (int k = 0; k < N; ++k) st[k] = operands[k]->strides()[d] * elsize_[k];
      if (ndim_ > 0) {
        bool merge = true;
        for (int k = 0; k < N; ++k)
          if (strides_[ndim_ - 1][k] != st[k] * shape[d]) merge = false;
        if (merge) {
          sizes_[ndim_ - 1] *= shape[d];
          for (int k = 0; k < N; ++k) strides_[ndim_ - 1][k] = st[k];
          continue;
        }
      }
      TS_ASSERT(ndim_ < kMaxDims);
      sizes_[ndim_] = shape[d];
      strides_[ndim_] = st;
      ndim_++;
    }
    numel_ = shape_numel(shape);
  }

  int64_t numel() const { return numel_; }

  // f(std::array<char*, N> ptrs, const std::array<int64_t, N>& byte_strides, int64_t n)
  template <class F>
  void run(F&& f, int64_t grain = 32768) const {
    if (numel_ == 0) return;
    if (ndim_ == 0) {
      std::array<int64_t, N> zero{};
      f(base_, zero, int64_t{1});
      return;
    }
    int64_t inner = sizes_[ndim_ - 1];
    int64_t outer = numel_ / inner;
    // Fewer rows than threads (a contiguous tensor coalesces to one row): the
    // rows are cut into pieces of at least `grain` elements, so that one long
    // run is still split across threads. Pieces are multiples of 64 elements,
    // which keeps each piece's vector loop aligned as the whole run's was.
    if (outer < num_threads() && inner >= 2 * grain) {
      int64_t pieces = std::min<int64_t>(inner / grain, (num_threads() + outer - 1) / outer);
      int64_t piece = ((inner + pieces - 1) / pieces + 63) / 64 * 64;
      pieces = (inner + piece - 1) / piece;
      parallel_for(0, outer * pieces, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          int64_t begin = (i % pieces) * piece;
          std::array<char*, N> ptrs = row_pointers(i / pieces);
          for (int k = 0; k < N; ++k) ptrs[k] += begin * strides_[ndim_ - 1][k];
          f(ptrs, strides_[ndim_ - 1], std::min(piece, inner - begin));
        }
      });
      return;
    }
    int64_t row_grain = grain / inner + 1;
    parallel_for(0, outer, row_grain, [&](int64_t r0, int64_t r1) {
      // Coordinates of row r0 in the outer dims, then advance like an odometer.
      std::array<int64_t, kMaxDims> idx = row_index(r0);
      std::array<char*, N> ptrs = row_pointers(r0);
      for (int64_t r = r0; r < r1; ++r) {
        f(ptrs, strides_[ndim_ - 1], inner);
        for (int d = ndim_ - 2; d >= 0; --d) {
          idx[d]++;
          for (int k = 0; k < N; ++k) ptrs[k] += strides_[d][k];
          if (idx[d] < sizes_[d]) break;
          for (int k = 0; k < N; ++k) ptrs[k] -= idx[d] * strides_[d][k];
          idx[d] = 0;
        }
      }
    });
  }

 private:
  static constexpr int kMaxDims = 12;

  // The coordinates of row r in the outer dims, and its operands' addresses.
  std::array<int64_t, kMaxDims> row_index(int64_t r) const {
    std::array<int64_t, kMaxDims> idx{};
    for (int d = ndim_ - 2; d >= 0; --d) {
      idx[d] = r % sizes_[d];
      r /= sizes_[d];
    }
    return idx;
  }
  std::array<char*, N> row_pointers(int64_t r) const {
    std::array<int64_t, kMaxDims> idx = row_index(r);
    std::array<char*, N> ptrs;
    for (int k = 0; k < N; ++k) {
      ptrs[k] = base_[k];
      for (int d = 0; d < ndim_ - 1; ++d) ptrs[k] += idx[d] * strides_[d][k];
    }
    return ptrs;
  }

  std::array<char*, N> base_{};
  std::array<int64_t, N> elsize_{};
  std::array<int64_t, kMaxDims> sizes_{};
  std::array<std::array<int64_t, N>, kMaxDims> strides_{};
  int ndim_ = 0;
  int64_t numel_ = 0;
};

}  // namespace tessera::cpu::TS_CPU_ISA
