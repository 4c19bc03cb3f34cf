// The CUDA backend's entry points in a build without CUDA (meson -Dcuda=disabled,
// or no CUDA toolkit found): nothing is available, and using a cuda device says so.
#include "runtime/check.h"
#include "runtime/cuda_backend.h"

namespace tessera::cuda {

namespace {
[[noreturn]] void no_cuda(int index) {
  TS_CHECK(false,
           "cuda:{}: this build of Tessera has no CUDA backend (configure with -Dcuda=enabled on a "
           "machine with the CUDA toolkit: nvcc, cuBLAS; see docs/gpu.md)",
           index);
}
}  // namespace

bool built() { return false; }
bool is_available() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return "this build of Tessera has no CUDA backend"; }
bool install_is_broken() { return false; }
bool cudnn_attention_built() { return false; }
int64_t cudnn_attention_calls() { return 0; }
std::string cudnn_attention_refusal() { return "this build has no CUDA backend"; }
std::string device_name(int index) { no_cuda(index); }
double free_memory(int index) { no_cuda(index); }
Stream& default_stream(int index) { no_cuda(index); }
StreamPtr new_stream(int index) { no_cuda(index); }
std::shared_ptr<Event> make_event(int index) { no_cuda(index); }
void synchronize(int index) { no_cuda(index); }
Allocator& allocator(int index) { no_cuda(index); }
const KernelTable& kernel_table() { no_cuda(0); }
std::shared_ptr<dist::ProcessGroup> nccl_group(const std::shared_ptr<dist::ProcessGroup>&) { no_cuda(0); }
void set_allow_tf32(bool) {}
bool tf32_allowed() { return false; }

}  // namespace tessera::cuda
