// The CPU backend's kernels, one function per kernel-table entry (the table
// in table.cpp; the asynchronous CPU test device queues the same functions).
#pragma once

#include "runtime/kernels.h"

namespace tessera::cpu {

DType compute_dtype(KernelFamily family, DType dtype);
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
void sum_squares(const Tensor&, const std::vector<Tensor>&);
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
void cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            int64_t);
void attention(const ops::AttentionResult&, const Tensor&, const Tensor&, const Tensor&, bool,
               double);
void attention_backward(const ops::AttentionGrads&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&, bool, double);
void rope(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
void uniform(const Tensor&, double, double, const RandomSpec&);
void normal(const Tensor&, double, double, const RandomSpec&);

}  // namespace tessera::cpu
