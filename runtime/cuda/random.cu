// Counter-based random fills on CUDA: the same Philox draws and transforms as
// the CPU (runtime/math.h), so a tensor initialised on a GPU holds the CPU's
// values for the same seed, stream and counters (uniform: bit for bit; normal:
// up to the last f64 bit of log and cos, which CUDA's libm may round
// differently from glibc before the value is rounded to the tensor's dtype).
#include "runtime/cuda/device_util.cuh"

namespace tessera::cuda {

namespace {

__device__ __forceinline__ uint64_t counter_of(const RandomArg& r, int64_t i) {
  if (r.linear) return static_cast<uint64_t>(r.base + i);
  int64_t counter = r.base, rem = i;
  for (int d = r.ndim - 1; d >= 0; --d) {
    counter += (rem % r.sizes[d]) * r.index_strides[d];
    rem /= r.sizes[d];
  }
  return static_cast<uint64_t>(counter);
}

__global__ void uniform_kernel(void* x, DType dt, int64_t n, double low, double high, RandomArg r) {
  TS_CUDA_LOOP(i, n) {
    double u0, u1;
    math::draw_uniforms(r.seed, r.stream, counter_of(r, i), u0, u1);
    store<double>(x, dt, i, dt == DType::F64 ? math::uniform_value(u0, low, high)
                                             : static_cast<float>(math::uniform_value(u0, low, high)));
  }
}

__global__ void normal_kernel(void* x, DType dt, int64_t n, double mean, double std, RandomArg r) {
  TS_CUDA_LOOP(i, n) {
    double u0, u1;
    math::draw_uniforms(r.seed, r.stream, counter_of(r, i), u0, u1);
    double v = math::normal_value(u0, u1, mean, std);
    store<double>(x, dt, i, dt == DType::F64 ? v : static_cast<float>(v));
  }
}

}  // namespace

void launch_uniform(void* x, DType dtype, int64_t n, double low, double high, const RandomArg& r,
                    cudaStream_t stream) {
  if (n == 0) return;
  uniform_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, dtype, n, low, high, r);
  check_launch("uniform");
}

void launch_normal(void* x, DType dtype, int64_t n, double mean, double std, const RandomArg& r,
                   cudaStream_t stream) {
  if (n == 0) return;
  normal_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, dtype, n, mean, std, r);
  check_launch("normal");
}

}  // namespace tessera::cuda
