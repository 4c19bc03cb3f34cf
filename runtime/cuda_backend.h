// What the rest of runtime/ asks of the CUDA backend (runtime/cuda/). In a
// build without CUDA these raise "this build has no CUDA" (runtime/cuda_stub.cpp),
// and is_available() is false.
#pragma once

#include <memory>
#include <string>

#include "runtime/allocator.h"
#include "runtime/stream.h"

namespace tessera {
struct KernelTable;
namespace dist {
class ProcessGroup;
}
}  // namespace tessera

namespace tessera::cuda {

bool built();                 // this build has the CUDA backend
bool is_available();          // built, and a GPU is visible
int device_count();           // 0 without CUDA or GPUs
// Attention on cuDNN's fused kernels: built in (the cuDNN frontend's headers
// were found), and how many forward and backward calls ran there so far.
bool cudnn_attention_built();
int64_t cudnn_attention_calls();
// Why cuDNN last refused an attention shape (the stage and cuDNN's message),
// "" while it has taken every one.
std::string cudnn_attention_refusal();
// Why no GPU can be used ("" when one can): no CUDA in the build, no driver,
// a driver older than the build's toolkit, or no device visible.
std::string unavailable_reason();
// True when the reason is an installation to fix (a driver too old for the
// toolkit, a failing driver) rather than a machine without GPUs.
bool install_is_broken();
std::string device_name(int index);
// Bytes free on GPU `index` now (cudaMemGetInfo): what a run may still allocate there.
double free_memory(int index);

Stream& default_stream(int index);
StreamPtr new_stream(int index);
std::shared_ptr<Event> make_event(int index);
void synchronize(int index);
Allocator& allocator(int index);
const KernelTable& kernel_table();

// A process group that moves CUDA tensors over NCCL (one communicator, made
// by a collective call on every rank of `base`) and everything else over
// `base` (runtime/cuda/nccl.cpp). Raises where the build has no NCCL.
std::shared_ptr<dist::ProcessGroup> nccl_group(const std::shared_ptr<dist::ProcessGroup>& base);

// f32 GEMMs in TF32 (faster, about 10 bits of mantissa): off unless asked.
void set_allow_tf32(bool allow);
bool tf32_allowed();

}  // namespace tessera::cuda
