// Host-side plumbing of the CUDA backend (internal to runtime/cuda/): error
// checks that name the call, the device this process uses, and the CUDA
// stream behind a tessera::Stream.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "runtime/check.h"
#include "runtime/cuda/iter.h"
#include "runtime/stream.h"

namespace tessera::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

#define TS_CUDA_CHECK(call)                                                               \
  do {                                                                                    \
    cudaError_t ts_err_ = (call);                                                         \
    if (ts_err_ != cudaSuccess) ::tessera::cuda::throw_cuda_error(ts_err_, #call, __FILE__, __LINE__); \
  } while (0)
#define TS_CUBLAS_CHECK(call)                                                             \
  do {                                                                                    \
    cublasStatus_t ts_st_ = (call);                                                       \
    if (ts_st_ != CUBLAS_STATUS_SUCCESS)                                                  \
      ::tessera::cuda::throw_cublas_error(ts_st_, #call, __FILE__, __LINE__);             \
  } while (0)

// Makes `index` the calling thread's current CUDA device (cheap when it is).
// A process uses one GPU: the first CUDA device it touches; another index raises.
void use_device(int index);
int process_device();  // the process's GPU (-1: none touched yet)

// The cudaStream_t behind a CUDA tessera::Stream, and the current one.
cudaStream_t raw_stream(Stream& stream);
cudaStream_t current_raw_stream();

// Where kernels record index errors on this device (checked at every sync).
DeviceError* device_error_slot();
// Raises the recorded device error, if any, naming the kernel (then clears it).
void raise_device_error();

cublasLtHandle_t cublaslt_handle();

}  // namespace tessera::cuda
