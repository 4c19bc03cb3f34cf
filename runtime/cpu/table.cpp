// The CPU backend's kernel table.
#include "runtime/distributed.h"
#include "runtime/kernels.h"

namespace tessera {
namespace cpu {

void copy(const Tensor&, const Tensor&);
void fill(const Tensor&, double);
void unary(ops::UnaryOp, const Tensor&, const Tensor&);
void unary_backward(ops::UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
void binary(ops::BinaryOp, const Tensor&, const Tensor&, const Tensor&);
void binary_scalar(ops::BinaryOp, const Tensor&, const Tensor&, double, bool);
void where(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
void pointwise(PointwiseOp, const Tensor&, const Tensor&, const Tensor&, double);
void clamp(const Tensor&, double, double);
void reduce(ReduceOp, const Tensor&, const Tensor&, int64_t, int64_t, int64_t);
void argmax_rows(const Tensor&, const Tensor&, const Tensor&);
double sum_squares(const Tensor&);
void gemm(DType, bool, bool, int64_t, int64_t, int64_t, double, const void*, int64_t,
          const void*, int64_t, double, void*, int64_t);
void softmax(const Tensor&, const Tensor&, bool);
void softmax_backward(const Tensor&, const Tensor&, const Tensor&, bool);
void layer_norm(const ops::NormResult&, const Tensor&, const Tensor&, const Tensor&, double, bool);
void layer_norm_backward(const ops::NormGrads&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, bool);
void embedding(const Tensor&, const Tensor&, const Tensor&);
void embedding_backward(const Tensor&, const Tensor&, const Tensor&);
void cross_entropy(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t);
void cross_entropy_backward(const Tensor&, double, const Tensor&, const Tensor&, const Tensor&,
                            int64_t);
void attention(const ops::AttentionResult&, const Tensor&, const Tensor&, const Tensor&, bool,
               double);
void attention_backward(const ops::AttentionGrads&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&, bool, double);
void rope(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
void uniform(const Tensor&, double, double, const RandomSpec&);
void normal(const Tensor&, double, double, const RandomSpec&);

const KernelTable kTable = {
    .copy = copy,
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

const KernelTable& kernels(Device device) {
  dist::progress();  // op boundary: in poll mode, in-flight collectives advance here
  TS_CHECK(device.is_cpu(), "no kernels for device {} in this build (CPU-only)", device.str());
  return cpu::kTable;
}

}  // namespace tessera
