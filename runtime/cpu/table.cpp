// The CPU backend's kernel table.
#include "runtime/cpu/kernels_cpu.h"

namespace tessera {
namespace cpu {

const KernelTable kTable = {
    .compute_dtype = static_cast<DType (*)(DType)>(&tessera::compute_dtype),  // bf16/f16 -> f32
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
}

const KernelTable& kernels(Device device) {
  if (device.is_cpu()) return cpu::kTable;
  if (device.type == DeviceType::AsyncCPU) return async_cpu::kTable;
  TS_CHECK(false, "no kernels for device {} in this build (CPU-only)", device.str());
}

void set_op_boundary_hook(void (*hook)()) { op_boundary_hook = hook; }

const KernelTable& dispatch(Device device) {
  if (op_boundary_hook != nullptr) op_boundary_hook();
  return kernels(device);
}

}  // namespace tessera
