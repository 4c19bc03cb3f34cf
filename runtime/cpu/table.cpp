// The CPU backend's kernel table.
#include <utility>

#include "runtime/cpu/kernels_cpu.h"
#include "runtime/cuda_backend.h"

namespace tessera {
namespace cpu {

// Every family computes bf16/f16 in f32 (and f64 in f64).
DType compute_dtype(KernelFamily, DType dtype) { return tessera::compute_dtype(dtype); }

const KernelTable kTable = {
    .compute_dtype = compute_dtype,
    .copy = copy,
    .copy_from_host = copy,
    .copy_to_host = copy,
    .fill = fill,
    .unary = unary,
    .unary_backward = unary_backward,
    .binary = binary,
    .binary_scalar = binary_scalar,
    .where = where,
    .pointwise = pointwise,
    .clamp = clamp,
    .reduce = reduce,
    .argmax_rows = argmax_rows,
    .sum_squares = sum_squares,
    .gemm = gemm,
    .softmax = softmax,
    .softmax_backward = softmax_backward,
    .layer_norm = layer_norm,
    .layer_norm_backward = layer_norm_backward,
    .embedding = embedding,
    .embedding_backward = embedding_backward,
    .cross_entropy = cross_entropy,
    .cross_entropy_backward = cross_entropy_backward,
    .attention = attention,
    .attention_backward = attention_backward,
    .rope = rope,
    .uniform = uniform,
    .normal = normal,
};

}  // namespace cpu

namespace {
void (*op_boundary_hook)() = nullptr;
// Tables a test installed, by DeviceType.
const KernelTable* replaced[4] = {};
}  // namespace

const KernelTable* replace_kernels_for_testing(DeviceType type, const KernelTable* table) {
  return std::exchange(replaced[static_cast<int>(type)], table);
}

const KernelTable& kernels(Device device) {
  if (const KernelTable* t = replaced[static_cast<int>(device.type)]) return *t;
  if (device.is_cpu()) return cpu::kTable;
  if (device.type == DeviceType::AsyncCPU) return async_cpu::kTable;
  if (device.is_cuda()) return cuda::kernel_table();
  TS_CHECK(false, "no kernels for device {}", device.str());
}

void set_op_boundary_hook(void (*hook)()) { op_boundary_hook = hook; }

const KernelTable& dispatch(Device device) {
  if (op_boundary_hook != nullptr) op_boundary_hook();
  return kernels(device);
}

}  // namespace tessera
