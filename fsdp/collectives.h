// The collectives of one parameter group (PyTorch: _fsdp_collectives.py):
// one all-gather per group in forward/backward, one reduce-scatter (and, for
// HSDP, one all-reduce) per group in backward.
#pragma once

#include "fsdp/fsdp_param.h"

namespace tessera::fsdp {

// An all-gather in flight: the flat output [W, per-rank total] (rank r's row
// is the concatenation of every parameter's padded shard of rank r).
struct AllGatherResult {
  Tensor output;
  dist::WorkPtr work;  // null when no collective was needed (world size 1)
  std::vector<int64_t> offsets;  // per parameter, within a rank's row
  int64_t row = 0;               // per-rank total
  int world = 1;
};

// Copy-in (each parameter's all-gather input into this rank's row of the
// output, cast to param_dtype) and one in-place all-gather over `group`.
AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params, const dist::ProcessGroupPtr& group,
                                   DType dtype);
// After the all-gather completed: copy each parameter's rows out into its
// unsharded buffer (allocating its bytes) and build the unsharded view.
void foreach_all_gather_copy_out(AllGatherResult& result, const std::vector<FSDPParam*>& params);

// A gradient reduction in flight. Stages: reduce-scatter running -> (HSDP)
// all-reduce running -> done (gradients written into the sharded .grad).
struct ReduceResult {
  std::vector<FSDPParam*> params;
  std::vector<int64_t> offsets;  // per parameter, within the output
  Tensor input;                  // [W * row], kept until the reduce-scatter completes
  Tensor output;                 // [row] in the reduce dtype
  dist::WorkPtr reduce_scatter;
  dist::WorkPtr all_reduce;
  MeshInfo mesh_info;
  bool all_reduce_grads = true;
  dist::ReduceOptions all_reduce_op;
  Tensor* partial_output = nullptr;  // HSDP without all-reduce: accumulate here instead
  bool done = false;
};

// How gradients are averaged: the reduce-scatter op, and the all-reduce op for
// HSDP (PyTorch's _get_gradient_divide_factors; one f32/bf16 rule here because
// bf16/f16 reductions run in f32 on the CPU).
struct DivideOps {
  dist::ReduceOptions reduce_scatter;
  dist::ReduceOptions all_reduce;
  double post_scale = 1.0;  // world size 1 with a custom factor
};
DivideOps divide_ops(const MeshInfo& mesh_info, std::optional<double> factor);

// Copy-in of the unsharded gradients (zero-padded per rank, cast to the reduce
// dtype) and an asynchronous reduce-scatter over the shard group.
ReduceResult foreach_reduce(const std::vector<FSDPParam*>& params, const std::vector<Tensor>& grads,
                            const MeshInfo& mesh_info, DType reduce_dtype, const DivideOps& ops,
                            bool all_reduce_grads, Tensor* partial_output);
// Waits for the reduce-scatter; for HSDP issues the all-reduce (or accumulates
// into the partial output). Call once the reduce-scatter should be done.
void advance_reduce(ReduceResult& r);
// Waits for everything and writes the sharded gradients (adding to existing ones).
void finish_reduce(ReduceResult& r);

}  // namespace tessera::fsdp
