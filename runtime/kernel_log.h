// What a step on the meta device runs, kernel by kernel and collective by
// collective, in program order: the input of the planner's step-time model
// (tools/step_time.h).
//
// The meta device has a kernel table of its own (meta_kernels below). Its
// entries run nothing; while a Recording is alive on the calling thread, each
// entry logs the kernel it stands for: its name, a signature (the dtypes,
// shapes, strides and arguments its time depends on), the bytes it reads and
// writes, its FLOPs, and a way to run the same CPU kernel on CPU tensors laid
// out as the step's, so that its time can be measured. Simulated process
// groups (dist::simulated_group) log each collective as issued and as waited
// for. Logging keeps no
// meta tensor alive, so a recorded step's memory plan is the same as an
// unrecorded one's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tessera {
struct KernelTable;
}

namespace tessera::kernel_log {

struct Kernel {
  std::string name;       // the kernel table entry: "gemm", "layer_norm", ...
  std::string signature;  // name, dtypes, shapes, strides and scalar arguments
  double bytes = 0;       // bytes of the tensors it reads and writes
  double flops = 0;       // of its products (gemm, attention); 0 for the rest
  // Makes CPU tensors laid out as the step's (floats filled with a constant,
  // integers 0) and returns a call of the CPU's kernel on them.
  std::function<std::function<void()>()> prepare;
};

struct Collective {
  std::string kind;   // "all_gather", "reduce_scatter", "all_reduce", ...
  std::string group;  // the process group's name: "dp_shard", "dp_replicate", "world"
  int group_size = 1;
  double bytes = 0;  // of the whole buffer: gathered, before scattering, or reduced (nccl-tests' size)
};

struct Event {
  enum class Type { Kernel, Issue, Wait };
  Type type;
  int64_t index;  // into Log::kernels or Log::collectives
};

struct Log {
  std::vector<Kernel> kernels;
  std::vector<Collective> collectives;
  std::vector<Event> events;  // in program order
  // The host's own time in the recorded step: its wall time less the time
  // spent logging (what the framework costs around the kernels: autograd,
  // the parallelisms' bookkeeping, allocation, shape checks).
  double host_seconds = 0;
};

// Logs the calling thread's meta kernels and simulated collectives into `log`
// while alive (not nested).
class Recording {
 public:
  explicit Recording(Log& log);
  ~Recording();
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
};

// Called by simulated process groups: the collective's index in the log, or
// -1 when nothing is being recorded.
int64_t collective_issued(const std::string& kind, const std::string& group, int group_size, double bytes);
void collective_waited(int64_t index);

}  // namespace tessera::kernel_log

namespace tessera::meta_kernels {
// The meta device's table: runs nothing, logs (above) while recording, and
// computes in the CPU's dtypes (bf16/f16 widened to f32), or natively in
// every dtype as the CUDA backend does once set_native_dtypes(true) (for a
// plan of a GPU; not thread-safe, set before planning).
extern const KernelTable kTable;
void set_native_dtypes(bool native);
bool native_dtypes();

// How bf16 matrix products run on the meta device when it plans for a CPU:
// as this CPU runs them (bf16 where oneDNN has bf16 kernels for it,
// AVX512-BF16 or AMX, or where the own f32 kernel widens them as it packs
// them, AVX2; f32 copies elsewhere: cpu::bf16_kernel), or as another CPU
// would, so that a plan made on one machine can show another's
// (docs/cpu.md): Native as oneDNN's AVX512-BF16 kernels, Amx as a CPU with
// AMX tiles (Tessera's AMX kernel, whose packed operands add to the peak,
// on the products wider than a tile: cpu::amx_kernel_takes), Own as an AVX2
// CPU (the own kernel's packed f32 operands), F32Copies as a CPU with none
// of them. Not thread-safe; set before planning.
enum class Bf16Products { ThisCpu, Native, Amx, Own, F32Copies };
void set_bf16_products(Bf16Products products);
Bf16Products bf16_products();
}  // namespace tessera::meta_kernels
