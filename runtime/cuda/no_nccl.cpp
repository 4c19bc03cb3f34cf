// A CUDA build without NCCL: CUDA runs at one rank; more are refused here.
#include "runtime/check.h"
#include "runtime/cuda_backend.h"
#include "runtime/distributed.h"

namespace tessera::cuda {

std::shared_ptr<dist::ProcessGroup> nccl_group(const std::shared_ptr<dist::ProcessGroup>& base) {
  TS_CHECK(false, "process group '{}': CUDA tensors across {} ranks need NCCL, which this build did not find "
           "(libnccl and nccl.h: see docs/gpu.md)", base->name(), base->size());
}

}  // namespace tessera::cuda
