// The device router: which kernel table serves a device, and the checked
// calls into it (runtime/kernels.h).
#include "runtime/kernels.h"

#include <utility>

#include "runtime/cpu/kernels_cpu.h"
#include "runtime/cuda_backend.h"
#include "runtime/kernel_log.h"

namespace tessera {

namespace {
void (*op_boundary_hook)() = nullptr;
// Tables a test installed, by DeviceType.
const KernelTable* replaced[4] = {};
}  // namespace

bool KernelTable::supports(OpId op) const {
  switch (op) {
#define TS_HAS_KERNEL(name, family, compute, params) \
  case OpId::name: return name != nullptr;
#define TS_NO_KERNEL(name, family) \
  case OpId::name: return false;
    TESSERA_OPS(TS_HAS_KERNEL, TS_HAS_KERNEL, TS_NO_KERNEL)
#undef TS_HAS_KERNEL
#undef TS_NO_KERNEL
  }
  return false;
}

void Kernels::missing(OpId op) const {
  TS_CHECK(false, "{}: the {} backend has no kernel for it, so it cannot run on {} (copy the tensors to a device "
           "that has one, e.g. .to(Device::cpu()))",
           op_name(op), table_->backend, device_.str());
}

const KernelTable* replace_kernels_for_testing(DeviceType type, const KernelTable* table) {
  return std::exchange(replaced[static_cast<int>(type)], table);
}

Kernels kernels(Device device) {
  if (const KernelTable* t = replaced[static_cast<int>(device.type)]) return {*t, device};
  if (device.is_cpu()) return {cpu::table(), device};
  if (device.type == DeviceType::AsyncCPU) return {async_cpu::kTable, device};
  if (device.is_meta()) return {meta_kernels::kTable, device};  // runs nothing; logs while recording
  if (device.is_cuda()) return {cuda::kernel_table(), device};
  TS_CHECK(false, "no kernels for device {}", device.str());
}

void set_op_boundary_hook(void (*hook)()) { op_boundary_hook = hook; }

Kernels dispatch(Device device) {
  if (op_boundary_hook != nullptr) op_boundary_hook();
  return kernels(device);
}

std::vector<std::pair<std::string, const KernelTable*>> all_kernel_tables() {
  std::vector<std::pair<std::string, const KernelTable*>> tables;
  for (cpu::Isa isa : {cpu::Isa::Baseline, cpu::Isa::Avx2, cpu::Isa::Avx512})  // built, whether or not this CPU runs it
    if (const KernelTable* t = cpu::isa_table(isa)) tables.emplace_back(fmt::format("cpu:{}", cpu::isa_name(isa)), t);
  tables.emplace_back("meta", &meta_kernels::kTable);
  tables.emplace_back("async_cpu", &async_cpu::kTable);
  if (cuda::built()) tables.emplace_back("cuda", &cuda::kernel_table());
  return tables;
}

}  // namespace tessera
