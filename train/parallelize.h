// The parallelism recipe of a language model, from plain options (in the
// spirit of TorchTitan's parallelize_llama): the device mesh the degrees make,
// tensor parallelism over its innermost dim, FSDP (HSDP on a 2-D data-parallel
// mesh) over the others, mixed precision and prefetch. What tessera-train and
// the planner run; an embedder's program calls the same.
//
//   train::ParallelismOptions opt{.tp = 2, .param_dtype = DType::BF16};
//   MeshPtr mesh = train::make_mesh(opt);
//   auto model = nn::make_model(cfg, Device::meta());
//   train::parallelize(*model, mesh, opt);
//   model->to_empty(mesh->device());
//   model->init_weights(seed);
#pragma once

#include <string>
#include <vector>

#include "dtensor/device_mesh.h"
#include "nn/models.h"
#include "pp/pipeline.h"
#include "runtime/checked.h"

namespace tessera::train {

struct ParallelismOptions {
  int64_t dp_replicate = 1;  // > 1: HSDP, a 2-D (dp_replicate, dp_shard) mesh
  int64_t dp_shard = -1;     // ranks a parameter is sharded over (-1: the ranks left)
  // > 1: Megatron tensor parallelism (tp/parallelize.h) over groups of this
  // many consecutive ranks, the mesh's innermost dim.
  int64_t tp = 1;
  bool loss_parallel = true;       // with tp: the output layer split over the vocabulary, the loss on its shards
  bool sequence_parallel = false;  // with tp: the residual stream and norms split on the sequence too
  // FSDP: free each block's gathered parameters after forward (false: ZeRO-2,
  // no all-gather in backward); a degree > 0 keeps them sharded over groups of
  // that many ranks instead (ZeRO++'s hpZ), and must divide dp_shard.
  bool reshard_after_forward = true;
  int64_t reshard_after_forward_degree = 0;
  bool prefetch = true;  // false: each group's all-gather only when the group runs
  bool cpu_offload = false;  // fsdp::CPUOffloadPolicy on every group
  DType param_dtype = DType::F32;   // the gathered parameters' (and the computation's) dtype
  DType reduce_dtype = DType::F32;  // the gradients' reduce-scatter dtype
  // > 1: pipeline parallelism (pp/pipeline.h) over this many stages' ranks,
  // the mesh's outermost dim; each stage's part sharded as above over the
  // rest. Its parameters stay gathered across the micro-batches (FSDP's
  // reshard_after_forward is false for them).
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";      // pp::schedule_names()
  int64_t pp_microbatches = 0;           // per step (0: 2 x pp)
  int64_t pp_stages_per_rank = 0;        // 0: 1, or 2 for interleaved_1f1b
  std::vector<int64_t> pp_layers_per_stage;  // empty: as even as they go
  std::vector<std::vector<std::string>> pp_module_names_per_stage;  // instead: pp::split_by_names
  // > 1: context parallelism (cp/context_parallel.h): every sequence split
  // over this many ranks, a mesh dim between dp_shard and tp; FSDP shards
  // over dp_shard x cp flattened ("dp_shard_cp", as TorchTitan does).
  int64_t cp = 1;
  std::string cp_rotate_method = "allgather";  // allgather | ring
  bool cp_load_balance = true;                 // head-tail chunks (false: contiguous runs)
  // > 1: expert parallelism (ep/expert_parallel.h): the experts of every MoE
  // layer split over groups of this many data-parallel ranks (it divides
  // dp_shard), tokens moved to them by all-to-all; the experts' own FSDP
  // shards over the dp_shard / ep ranks holding the same experts
  // (TorchTitan's dp_shard_mod_ep), their gradients divided by every data rank.
  // With tp > 1 the experts are whole on every tensor-parallel rank, and the
  // ranks of one tp index exchange their tokens (no expert tensor parallelism).
  int64_t ep = 1;
};

// The mesh, outermost dim first: pp (when > 1), dp_replicate (when > 1),
// dp_shard, cp (when > 1), tp (when > 1), for world_size ranks; throws naming the option (through `names`, as
// nn's validation does) when the degrees do not make world_size.
struct MeshDims {
  Shape shape;
  std::vector<std::string> names;
  int64_t pp = 1, replicate = 1, shard = 1, cp = 1, tp = 1;
  int64_t ep = 1;  // carved out of shard: the experts' mesh is (replicate, shard / ep, ep[, tp])
  int64_t data_parallel() const { return replicate * shard; }  // ranks that see different data
};
MeshDims mesh_dims(const ParallelismOptions& options, int world_size, const FieldNames& names = {});
// init_device_mesh over every rank of the job with mesh_dims' shape and names.
MeshPtr make_mesh(const ParallelismOptions& options, const std::string& device_type = "cpu");

// Shards `model` (built on meta, not yet materialised) over `mesh` (made by
// make_mesh): tensor parallelism over its "tp" dim when it has one, context
// parallelism over its "cp" dim (forward_backward then hands the model this
// rank's slice of each sequence), expert parallelism (options.ep) over a mesh
// of its own, (dp_replicate, dp_shard_mod_ep, ep, tp) on the same ranks
// (DeviceMesh::unflatten of dp_shard), then FSDP
// over the data dims, each block (an MoE block's experts first, over
// dp_shard_mod_ep) and then the root. MoE layers balance over all data ranks.
void parallelize(nn::LanguageModel& model, const MeshPtr& mesh, const ParallelismOptions& options);

// The pipeline over the mesh's "pp" dim (options.pp > 1): this rank's stage
// parts of the model `cfg` describes, each parallelized as above over the
// other dims, materialised on the mesh's device and initialised as the full
// model's init_weights(seed). The schedule is validated before anything is
// allocated.
std::shared_ptr<pp::Pipeline> make_pipeline(const nn::TransformerConfig& cfg, const MeshPtr& mesh,
                                            const ParallelismOptions& options, uint64_t seed);

}  // namespace tessera::train
