// The planner: one rank's memory and communication for a training config at
// any number of ranks, predicted before a run by running the step itself on
// the meta device.
//
// The model is built and sharded exactly as tessera-train builds it (with
// train/'s parallelize, make_optimizer and forward_backward, from the
// configuration's options), over simulated process groups (dist::simulated_group) that play rank r
// of a world of W without communicating, and two training steps run on meta
// tensors under a MetaAccounting (runtime/allocator.h). Every tensor the step
// allocates is counted as the device's allocator counts it, every collective
// is counted as the real group counts it, and nothing is computed, so a plan
// of a model that could never fit takes milliseconds. What is not a tensor
// (the token arrays of the data loader, MPI's and the BLAS's own buffers) is
// not in the plan.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fully_shard.h"
#include "nn/optim.h"
#include "runtime/kernel_log.h"
#include "tools/config.h"

namespace tessera::tools {

// The groups that parallelism.reshard_after_forward_degree N gives each FSDP
// group for its backward all-gathers (N ranks each; a plan sums their
// collectives as "dp_shard/post-forwardN"); none otherwise.
std::vector<dist::ProcessGroupPtr> post_forward_groups(nn::Module& model);
// The groups expert parallelism made (train::parallelize): "ep", over which
// the tokens are dispatched, and "dp_shard_mod_ep", the experts' FSDP.
std::vector<std::pair<std::string, dist::ProcessGroupPtr>> expert_groups(nn::Module& model);
// The groups of the dims train::parallelize flattens, by name: FSDP's over
// data x context ("dp_shard_cp") when the mesh has a "cp" dim.
std::vector<std::pair<std::string, dist::ProcessGroupPtr>> flattened_groups(const MeshPtr& mesh);

struct Plan {
  int world_size = 1, rank = 0;
  int64_t replicate = 1, shard = 1;  // the data-parallel mesh
  int64_t parameters = 0;            // in the model (tied weights once)
  int64_t micro_batch = 0;           // sequences per rank per micro-batch
  // The dtype bf16 matrix products were planned in, and why: "bf16 (this
  // CPU's AMX tiles: ...)", "f32 copies (...)", ... (meta_kernels::Bf16Products).
  // Two CPUs plan a bf16 run's peak differently by the f32 copies, and AMX's
  // by its packed operands.
  std::string bf16_products;
  // Bytes the allocator holds in tensors (memory_stats' allocated_bytes).
  int64_t sharded_parameters = 0;  // this rank's shards, padded, after the first forward
  int64_t optimizer_state = 0;     // after the first step
  int64_t gradients = 0;           // sharded gradients, before the optimizer step
  int64_t forward_peak = 0;        // peak above the steady state in forward + backward
  // The predicted peak over two steps. A collective's buffers go when it is
  // waited for, in the plan as in a run (however early it completed), so a
  // run's peak does not depend on the timing of the other ranks.
  int64_t peak = 0;
  // Bytes held after each transformer block's forward (saved for backward
  // and, with reshard_after_forward false, the block's gathered parameters),
  // above what was held before the first block. One entry per block.
  std::vector<int64_t> after_block;
  int64_t end_of_forward = 0;  // held when the loss is computed, above the steady state
  // Collectives per step (the second, steady step), by group name:
  // "dp_shard", "dp_replicate" (HSDP), "world" (the loss average) and
  // "dp_shard/post-forwardN" (reshard_after_forward_degree N, summed).
  std::map<std::string, dist::CollectiveStats> collectives;
  // FLOPs per step on this rank: matmuls and attention (PaLM's estimate),
  // forward, backward (twice forward) and the forward recomputed in backward
  // under activation checkpointing. The model's FLOPs are counted once: a
  // tensor-parallel rank gets 1/degree of its group's.
  double flops_forward = 0, flops_backward = 0, flops_recompute = 0;
  // A pipeline (parallelism.pipeline_parallel_degree > 1): this rank's
  // stages, the most micro-batches one of them held activations for at once
  // in the planned step (1F1B: min(m, p - s) on stage s; GPipe: m), and the
  // schedule's bubble, simulated with a backward twice a forward (pp::simulate).
  // Its messages are collectives["pp"]'s send and recv.
  std::string pp_stages;
  int pp_microbatches = 0, pp_in_flight = 0;
  double pp_bubble = 0;
  // A mixture of experts: the routed experts' parameters (every MoE layer,
  // all experts) and the bytes of this rank's shards of them; the
  // dispatch/combine all-to-alls are collectives["ep"] (5 per MoE layer and
  // micro-batch: the counts, dispatch and combine forward, combine and
  // dispatch backward), their bytes at balanced routing (the meta device
  // routes round-robin). At the worst routing a rank's experts receive up to
  // moe_imbalance_bound times the balanced rows: ep x min(top_k, experts
  // per rank) / top_k, and so do its dispatch buffers and expert activations.
  int64_t expert_parameters = 0, expert_bytes = 0;
  double moe_imbalance_bound = 1;
  // The steady step's kernels and collectives in program order, from the
  // forward to the optimizer (for the step-time model, tools/step_time.h);
  // null unless asked for.
  std::shared_ptr<const kernel_log::Log> step_log;
};

// While alive, plans are made as for a GPU: the meta device computes bf16
// and f16 natively (no f32 copies, as the CUDA backend) and simulated
// collectives allocate NCCL's buffers (no MPI staging).
class PlanAsGpu {
 public:
  PlanAsGpu();
  ~PlanAsGpu();
  PlanAsGpu(const PlanAsGpu&) = delete;
  PlanAsGpu& operator=(const PlanAsGpu&) = delete;
};

// tessera-train's OpenMP threads per rank when `ranks_here` ranks share this
// node: OMP_NUM_THREADS when set, else the cores divided among the ranks.
int threads_per_rank(int ranks_here);

// The CPUs tessera-train keeps a rank's threads to (job.bind_cores): rank
// `local_rank` of the node's `local_size`, `threads` each, gets its own
// consecutive block of the CPUs the process may use when the node's ranks fit
// them, so that no two ranks share a core and a rank's communication thread
// runs beside its own compute (measured: benchmarks/README.md, the planner).
// Empty, for no pinning, when they do not fit (4 ranks on 2 cores: the
// scheduler then gives a waiting rank's core to one that computes), for a
// node of one rank (nothing to keep apart; and two single-rank jobs would
// both take the first cores), or when the launcher already bound the rank
// (its mask is narrower than the machine's CPUs).
std::vector<int> rank_cpus(int local_rank, int local_size, int threads);

// MFU's denominator when metrics.peak_tflops is 0 (the default): this node's
// peak FLOP/s for products of `param_dtype` ("float32" or "bfloat16") on the
// CPUs `ranks_here` ranks of `threads` threads use (at most all of them),
// measured on that many threads at once (runtime/cpu/peak.h: the FMA for
// f32; AMX, else AVX512-BF16, for bf16). Load can only lower a measurement,
// so the best one made for this CPU, unit and thread count is kept in
// <cache_dir>/peaks.txt and the larger is returned. `how` gets the unit's name
// and which of the two it is.
double node_peak_flops(const std::string& param_dtype, int ranks_here, int threads, std::string* how = nullptr);

// Plans rank `rank` of world_size ranks for `cfg` (validated here). Throws as
// tessera-train would for a config that cannot run at that world size.
// log_step records Plan::step_log.
Plan plan_run(const TrainConfig& cfg, int world_size, int rank = 0, bool log_step = false);

// A pipeline's plan per stage position: the first rank of each pipeline
// rank's group (pp outermost: rank i x world_size / degree), whose data-
// parallel peers hold the same stages. Without a pipeline, rank 0's plan.
std::vector<Plan> plan_stage_positions(const TrainConfig& cfg, int world_size);
// Those plans as a table: each position's stages, micro-batches in flight,
// messages, peak.
std::string format_stage_plans(const std::vector<Plan>& plans);

// Refuses, before anything is allocated, a run whose planned peak (rank 0's,
// the largest shards; under a pipeline the largest of its stage positions')
// times the ranks on this node exceeds available_bytes:
// the error holds the plan and the predicted peak of the nearest settings
// (activation checkpointing, a smaller micro-batch, bf16 parameters, twice
// the ranks), each marked whether it fits. cfg.job.check_memory false skips it.
void check_planned_memory(const TrainConfig& cfg, int world_size, int ranks_here, double available_bytes);

// The plan as tables for a person: per group the bytes handed to MPI and
// those a ring algorithm sends, beside ZeRO-3's estimate ((W-1)/W x params
// x (2 x param bytes + gradient bytes), every parameter gathered twice).
std::string format_plan(const Plan& plan, const TrainConfig& cfg);

}  // namespace tessera::tools
