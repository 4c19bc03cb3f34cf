// The sharding rules: for each op of runtime/op_list.h that DTensors reach,
// which placements it takes, which collective or local computation gives its
// result, and its results' placements. An op on DTensors arrives as an
// OpCall (runtime/op_call.h); the rule registered for its id handles it.
// One file per op family, as PyTorch splits torch/distributed/tensor/_ops/:
//
//   rules_pointwise.cpp       elementwise ops, in-place updates, copies laid out as their input
//   rules_reductions.cpp      sum (a reduced split dim becomes Partial); var, max, argmax refused
//   rules_matrix.cpp          linear, matmul and linear's backward (column-, row-, batch-wise)
//   rules_norm.cpp            layer_norm, rms_norm on split rows (sequence parallelism)
//   rules_attention.cpp       softmax, attention, RoPE: each shard alone along their independent dims
//   rules_embedding_loss.cpp  embedding split on the vocabulary or features; loss-parallel cross-entropy
//   rules_random.cpp          random fills: each element draws the counter of its global position
//   rules_views.cpp           view, reshape, permute, transpose; a gradient laid out as its parameter
//
// Internal to the dtensor layer.
#pragma once

#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/redistribute.h"
#include "runtime/op_call.h"

namespace tessera::detail {

using ShardingRule = TensorList (*)(OpCall& call);

// Registers `rule` for `op` (each family file's register_*_rules does, once).
void register_rule(OpId op, ShardingRule rule);
// The rule for `op`, or null where none is registered.
ShardingRule rule_for(OpId op);
// Registers every family's rules and installs the handler of OpCalls (once;
// make_dtensor calls it, so that no DTensor exists without its rules).
void register_sharding_rules();

void register_pointwise_rules();
void register_reduction_rules();
void register_matrix_rules();
void register_norm_rules();
void register_attention_rules();
void register_embedding_loss_rules();
void register_random_rules();
void register_view_rules();

// A rule that refuses the op on DTensors, naming it and the first DTensor
// among its inputs (cat, max, a strided view, ...).
TensorList no_rule(OpCall& call);

// ---- helpers the rules share ---------------------------------------------------

const Tensor* first_dtensor(const TensorList& inputs);
bool is_scalar_plain(const Tensor& t);
Placements without_partial(const Placements& ps);
bool has_partial(const Placements& ps);
// Placement of one operand on mesh dim i ("plain" operands count as Replicate).
Placement placement_at(const Tensor& t, size_t i);
// The local tensors of the inputs, each DTensor first moved to `placements`
// (plain inputs must be scalars, kept as they are).
TensorList locals_at(const OpCall& call, const DTensorSpec& ref, const Placements& placements);
// A 0-dim operand's value on this rank (a Replicate or Partial DTensor reduced first).
Tensor scalar_value(const Tensor& t);

}  // namespace tessera::detail
