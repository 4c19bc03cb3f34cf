// Tensor parallelism on DTensor, as PyTorch's torch.distributed.tensor.parallel.
//
// parallelize_module(module, mesh, plan) turns the Linear layers a plan names
// into tensor-parallel layers: their weights become DTensors sharded over the
// mesh (Megatron's split: a column-wise layer keeps some output features on
// each rank, a row-wise one some input features), and forward hooks convert
// their inputs and outputs at the layer's boundary. Inside, linear runs on
// DTensors by the dtensor layer's sharding rule, forward and backward
// (dtensor/ops.cpp); outside, with use_local_output, the model sees plain
// local tensors, so the code between two layers (attention on this rank's
// heads, an activation on this rank's features) runs unchanged.
//
// A column-wise layer followed by a row-wise one (attention's q/k/v then its
// output projection; an MLP's up then down projection) needs one all-reduce
// in forward (the row-wise output, Partial -> Replicate) and one in backward
// (the column-wise input's gradient, Partial -> Replicate): Megatron's f and
// g operators, here the redistributes of the layers' boundaries.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/dtensor.h"
#include "nn/models.h"

namespace tessera::tp {

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  // Parallelizes `module` (found at `fqn` in the model) over a 1-D mesh.
  virtual void apply(nn::Module& module, const MeshPtr& mesh, const std::string& fqn) const = 0;
  virtual std::string name() const = 0;
};
using StylePtr = std::shared_ptr<const ParallelStyle>;

// Column-wise: weight [out, in] and bias sharded on out (Shard(0)); the input
// arrives in input_layout and is made Replicate; the output, sharded on its
// last dim, is redistributed to output_layout and, with use_local_output,
// handed on as this rank's local tensor.
//
// blocks > 1 splits a fused projection of that many equal outputs each on
// its own (GPT-2's c_attn, [q | k | v]: blocks = 3): weight and bias
// S(0)xblocks, so a rank holds its heads' q, k and v, and a Shard(-1)
// output_layout means the same split of the output, S(-1)xblocks (a
// Replicate one gathers it back to [q | k | v]).
struct ColwiseParallel {
  Placement input_layout = Replicate{};
  Placement output_layout = Shard{-1};
  bool use_local_output = true;
  int64_t blocks = 1;
};
// Row-wise: weight sharded on in (Shard(1)), bias replicated; the input
// arrives in input_layout and is made Shard(-1); the output, a Partial sum,
// is redistributed to output_layout (Replicate: an all-reduce).
struct RowwiseParallel {
  Placement input_layout = Shard{-1};
  Placement output_layout = Replicate{};
  bool use_local_output = true;
};
// Converts a module's (first) input: a plain tensor is taken to be laid out as
// input_layout, then redistributed to desired_input_layout; handed on as a
// DTensor unless use_local_output. On a block's attention or MLP it makes the
// input a Replicate DTensor once, so that the gradients of the column-wise
// layers reading it add up as Partial DTensors and are all-reduced once (not
// once per projection).
struct PrepareModuleInput {
  Placement input_layout = Replicate{};
  Placement desired_input_layout = Replicate{};
  bool use_local_output = false;
};
// Converts a module's output DTensor from output_layout (a plain output is
// taken to be laid out so) to desired_output_layout; local unless told not.
struct PrepareModuleOutput {
  Placement output_layout = Replicate{};
  Placement desired_output_layout = Replicate{};
  bool use_local_output = true;
};
// Sequence-parallel: a norm (LayerNorm, RMSNorm) run on activations split on
// the sequence dim, each rank normalising its own tokens (Megatron-3's
// sequence parallelism, PyTorch's SequenceParallel). Its weight and bias
// become Replicate DTensors, whose gradients, each rank's sum over its own
// tokens, are all-reduced as they accumulate. A DTensor input is taken as it
// is; a plain one as this rank's share of sequence_dim split evenly (as
// PyTorch's from_local: hand on DTensors when the length does not divide).
// The output is handed on as a DTensor unless use_local_output.
struct SequenceParallel {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
};
StylePtr style(ColwiseParallel options);
StylePtr style(RowwiseParallel options);
StylePtr style(PrepareModuleInput options);
StylePtr style(PrepareModuleOutput options);
StylePtr style(SequenceParallel options);

// Module paths (relative to the module given to parallelize_module; "*"
// matches any one path component, as in "layers.*.mlp.up_proj"; "" is the
// module itself) and the
// style each gets. A path that matches nothing, or names a module the style
// cannot parallelize, is an error naming it.
using ParallelizePlan = std::vector<std::pair<std::string, StylePtr>>;

// Applies the plan over `mesh` (1-D: the tensor-parallel dim; slice a larger
// mesh by name). Works on a model built on meta (the shards get their bytes
// at to_empty and their values from init_weights, equal to the full model's
// sliced) or on a real one (each weight is cut from mesh rank 0's).
void parallelize_module(nn::Module& module, const MeshPtr& mesh, const ParallelizePlan& plan);

// The Megatron plans of the two models' blocks, as TorchTitan's
// parallelize_llama: attention's q/k/v column-wise and its output projection
// row-wise (each rank computes n_head / degree heads, and n_kv_head / degree
// key/value heads; GPT-2's fused c_attn split per block, S(0)x3, so that a
// rank's share of it is its heads' q, k and v), the MLP's up (and gate)
// projections column-wise and its down projection row-wise, the embedding
// table split over the vocabulary (Megatron's VocabParallelEmbedding: each
// rank looks up its own tokens, one all-reduce completes the rows). Norms and
// GPT-2's position table stay replicated; each block's attention and MLP
// take their input as a Replicate DTensor (PrepareModuleInput), so that a
// block costs two all-reduces forward and two backward, Megatron's count.
// A Llama's mixture of experts (block_sparse_moe) is not split: it runs
// whole on every tensor-parallel rank, on its input gathered whole, and
// hands its output back in the blocks' layout (expert parallelism splits the
// experts over the data-parallel ranks instead: train/parallelize.h).
// Throws naming the field when a head count does not divide by the degree.
//
// sequence_parallel splits the activations between the blocks on the
// sequence (Shard(1)): the norms run on each rank's tokens, each attention
// and MLP all-gathers its input and reduce-scatters its output. Llama's
// embedding is reduce-scattered straight to that split; GPT-2's is
// all-reduced, its positions added, and then split (its dropout runs on the
// split: Megatron's scatter_to_sequence_parallel_region, an all-gather of
// the gradient backward).
//
ParallelizePlan tensor_parallel_plan(const nn::LanguageModel& model, int64_t degree, bool loss_parallel = false,
                                     bool sequence_parallel = false);

}  // namespace tessera::tp
