// The kernel tables: one per backend, one entry per KERNEL row of
// runtime/op_list.h, generated from that list. The ops in runtime/ops.h check
// shapes, allocate outputs and call a table through `dispatch(device)`, whose
// calls check that the backend has the kernel: a missing one is an error
// naming the op and the device, never a call through a null pointer.
// Internal to the library (not installed): adding an op adds an entry.
#pragma once

#include <array>
#include <utility>
#include <vector>

#include "runtime/kernel_kinds.h"
#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera {

struct KernelTable {
  const char* backend = "";  // named in errors: "cpu", "meta", "async_cpu", "cuda"
  // The dtype the float kernels of `family` compute in for tensors of `dtype`
  // (which dtypes this backend takes natively, family by family).
  DType (*compute_dtype)(KernelFamily family, DType dtype) = nullptr;
  // One entry per KERNEL row of runtime/op_list.h: `void (*rope)(const Tensor&
  // out, ...)`. Null where the backend lacks the kernel.
#define TS_KERNEL_ENTRY(name, family, compute, params) void(*name) params = nullptr;
#define TS_NO_ENTRY(name, family)
  TESSERA_OPS(TS_KERNEL_ENTRY, TS_KERNEL_ENTRY, TS_NO_ENTRY)
#undef TS_KERNEL_ENTRY
  // The kernels the backend says it does not have (the CUDA table: the
  // list's CPU_KERNEL rows). Any other null entry is a forgotten one:
  // tests/runtime/test_ops.cpp fails on it.
  std::array<bool, kNumOps> lacks{};
  // Whether attention and attention_backward take q, k, v, dout and out with
  // unit stride along head_dim and any other strides, and write out, dq, dk
  // and dv in the layouts they are given (the CPU's); else runtime/ops_nn.cpp
  // hands them contiguous tensors and contiguous outputs.
  bool strided_attention = false;
  // Whether reduce and embedding_backward take bf16 and f16 inputs as they
  // lie and sum them into f32 (each element widened as it is read: the bits of
  // summing a widened copy); else runtime/ops_math.cpp and ops_nn.cpp hand
  // them f32 copies.
  bool sums_widen = false;
  // Whether the table has `op`'s kernel (false for ops without a kernel row).
  bool supports(OpId op) const;
};

// A table with the device it serves: what `kernels` and `dispatch` return.
// Each call has its entry's name and arguments and throws when the backend
// lacks the kernel (an op with a composite checks supports() first).
class Kernels {
 public:
  Kernels(const KernelTable& table, Device device) : table_(&table), device_(device) {}
  DType compute_dtype(KernelFamily family, DType dtype) const { return table_->compute_dtype(family, dtype); }
  bool supports(OpId op) const { return table_->supports(op); }
  const KernelTable& table() const { return *table_; }
#define TS_KERNEL_CALL(name, family, compute, params)        \
  template <class... A>                                      \
  void name(A&&... args) const {                             \
    if (table_->name == nullptr) missing(OpId::name);        \
    table_->name(std::forward<A>(args)...);                  \
  }
  TESSERA_OPS(TS_KERNEL_CALL, TS_KERNEL_CALL, TS_NO_ENTRY)
#undef TS_KERNEL_CALL

 private:
  [[noreturn]] void missing(OpId op) const;
  const KernelTable* table_;
  Device device_;
};
#undef TS_NO_ENTRY

// The table for a device; throws for a device this build has no kernels for.
Kernels kernels(Device device);
// What ops call: an op boundary (runs the hook below), then kernels(device).
Kernels dispatch(Device device);
// Every backend table this build has, for tests that walk them: the CPU's
// instruction-set copies ("cpu:baseline", ...), "meta", "async_cpu" and, where
// compiled, "cuda".
std::vector<std::pair<std::string, const KernelTable*>> all_kernel_tables();
// Installs `table` for devices of `type` in place of the built-in one (nullptr
// restores it) and returns what was installed: lets a test check what the ops
// layer hands a backend with other native dtypes. Not thread-safe.
const KernelTable* replace_kernels_for_testing(DeviceType type, const KernelTable* table);
// Runs at every op boundary. dist registers MPI progress here in poll mode
// (TESSERA_PROGRESS=poll); nothing runs otherwise.
void set_op_boundary_hook(void (*hook)());

namespace cpu {
const KernelTable& table();  // the instruction-set copy in use (runtime/cpu/isa.h)
}
namespace async_cpu {
extern const KernelTable kTable;  // the CPU kernels, queued on async_cpu streams
}

}  // namespace tessera
