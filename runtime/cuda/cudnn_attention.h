// Attention on cuDNN's fused kernels (internal to runtime/cuda/;
// cudnn_attention.cpp says what it takes). Each call returns false when
// cuDNN does not take the dtype or shape (or the build has no cuDNN
// frontend, or TESSERA_CUDNN_ATTENTION=0): the caller then runs the own kernels.
#pragma once

#include <cstdint>

#include "runtime/cuda/launch.h"

namespace tessera::cuda {

// q [B, H, T, D], k/v [B, Hkv, S, D], out like q, lse [B, H, T] f32; on the current stream.
bool cudnn_attention(void* out, void* lse, const void* q, const void* k, const void* v, DType dtype,
                     DType lse_dtype, const AttentionShape& shape);
bool cudnn_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                              const void* v, const void* out, const void* lse, DType dtype, DType lse_dtype,
                              const AttentionShape& shape);
// cudnn_attention_built() and cudnn_attention_calls(): runtime/cuda_backend.h.

}  // namespace tessera::cuda
