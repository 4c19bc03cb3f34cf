// Device-side helpers the CUDA kernels share: typed loads and stores by
// dtype, offsets of strided operands, grid sizes and block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "runtime/cuda/launch.h"
#include "runtime/math.h"

namespace tessera::cuda {

constexpr int kThreads = 256;

inline unsigned grid_for(int64_t n, int threads = kThreads) {
  int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 16 ? 65535 * 16 : blocks));
}

// Loads element `i` of a `dt` array as C (float, double, int64_t or bool).
template <class C>
__device__ __forceinline__ C load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::F32: return static_cast<C>(static_cast<const float*>(p)[i]);
    case DType::F64: return static_cast<C>(static_cast<const double*>(p)[i]);
    case DType::BF16: return static_cast<C>(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
    case DType::F16: return static_cast<C>(__half2float(static_cast<const __half*>(p)[i]));
    case DType::I32: return static_cast<C>(static_cast<const int32_t*>(p)[i]);
    case DType::I64: return static_cast<C>(static_cast<const int64_t*>(p)[i]);
    case DType::Bool: return static_cast<C>(static_cast<const bool*>(p)[i]);
  }
  return C(0);
}

// Stores v into element `i` of a `dt` array, rounding to nearest-even (as the CPU).
template <class C>
__device__ __forceinline__ void store(void* p, DType dt, int64_t i, C v) {
  switch (dt) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::F64: static_cast<double*>(p)[i] = static_cast<double>(v); return;
    case DType::BF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
      return;
    case DType::F16: static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v)); return;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
    case DType::I64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); return;
    case DType::Bool: static_cast<bool*>(p)[i] = v != C(0); return;
  }
}

// Grid-stride loop over [0, n).
#define TS_CUDA_LOOP(i, n)                                                          \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// The sum / max of v over the block (every thread gets it). `shared` holds
// blockDim.x / 32 values of T.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    T w = __shfl_xor_sync(0xffffffffu, v, o);
    v = (w > v || w != w) ? w : v;
  }
  return v;
}
template <class T>
__device__ T block_sum(T v, T* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // shared may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < warps; ++w) total += shared[w];  // fixed order: deterministic
  return total;
}
template <class T>
__device__ T block_max(T v, T* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T m = shared[0];
  for (int w = 1; w < warps; ++w) m = (shared[w] > m || shared[w] != shared[w]) ? shared[w] : m;
  return m;
}

// Calls f(C{}) with the type a float kernel on `dt` computes in: f64 for f64,
// f32 for f32, bf16 and f16.
template <class F>
void with_float(DType dt, F&& f) {
  if (dt == DType::F64) f(double{});
  else f(float{});
}

// Checks a launch (configuration errors surface here; faults at the next sync).
void check_launch(const char* kernel);
// Throws naming `what` when a library call that queues kernels (CUB's sort) failed.
void check_queued(cudaError_t err, const char* what);

}  // namespace tessera::cuda
