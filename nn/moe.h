// A mixture of experts in place of a Llama block's MLP (Mixtral, Qwen-MoE,
// DeepSeek-V3, Llama 4): a router picks top_k of num_experts SwiGLU experts
// for every token, the token's output is the experts' outputs weighed by the
// router, plus optional shared experts every token passes through.
//
// One forward, for N tokens of width C:
//   route     scores = softmax or sigmoid of gate(x) [N, E], in f32 at least;
//             top_k experts per token by score (+ expert_bias with bias
//             balancing, for the choice only), chosen on the host;
//   dispatch  the N x top_k (token, expert) pairs sorted by expert: the
//             tokens' rows gathered into runs, one run per expert;
//   experts   one SwiGLU product per non-empty run (GroupedExperts);
//   combine   each pair's output weighed by its router weight, summed per token.
// No token is dropped (no capacity). Under expert parallelism (ep/) the runs
// travel to the ranks that hold their experts and back (ExpertPlacement).
#pragma once

#include <functional>
#include <vector>

#include "nn/transformer.h"
#include "runtime/distributed.h"

namespace tessera::nn {

// The experts' weights stacked on a leading expert dim, each slice in
// Linear's [out, in] layout: w1 (gate) and w3 (up) [E, H, C], w2 (down)
// [E, C, H]. Under expert parallelism they are DTensors split on dim 0.
class GroupedExperts : public Module {
 public:
  GroupedExperts(int64_t num_experts, int64_t dim, int64_t hidden, double down_std, Device device);
  // Rows x [M, C] in runs of counts[e] rows for each held expert e (in
  // order; empty runs allowed) -> each row's expert output [M, C].
  Tensor run(const Tensor& x, const std::vector<int64_t>& counts);
  void reset_parameters(uint64_t seed, const std::string& prefix) override;
  std::string type_name() const override { return "GroupedExperts"; }

  int64_t num_experts, dim, hidden;
  double down_std;
  Tensor& w1;
  Tensor& w2;
  Tensor& w3;
};

// Where the experts of an MoE layer run. Without one every expert runs here;
// expert parallelism (ep/expert_parallel.h) moves each expert's run of rows
// to the rank that holds it and the outputs back.
class ExpertPlacement {
 public:
  virtual ~ExpertPlacement() = default;
  // Runs rows x [M, C] in runs of counts[e] rows per expert (all experts, in
  // order) through `local`, which runs this rank's experts on their rows
  // (runs of its own counts, in its experts' order), and returns every row's
  // output in x's order.
  using LocalExperts = std::function<Tensor(const Tensor& x, const std::vector<int64_t>& counts)>;
  virtual Tensor run(const Tensor& x, const std::vector<int64_t>& counts, const LocalExperts& local) = 0;
};

// What one MoE layer routed.
struct RoutingStats {
  std::vector<int64_t> tokens_per_expert;  // (token, expert) pairs per expert
  double max_over_mean() const;            // the imbalance: 1 when every expert gets the same
};

class MoE : public Module {
 public:
  MoE(const TransformerConfig& cfg, Device device);
  Tensor forward(const Tensor& x) override;  // [..., C] -> [..., C]
  void reset_parameters(uint64_t seed, const std::string& prefix) override;  // zeroes expert_bias
  std::string type_name() const override { return "MoE"; }

  int64_t num_experts, top_k;
  bool sigmoid;     // cfg.moe_router == "sigmoid" (else softmax)
  bool norm_topk;   // the chosen weights rescaled to sum to 1 (always with sigmoid)
  std::string balance;  // none | aux_loss | bias
  double balance_coeff;
  std::shared_ptr<Linear> gate;  // router: [E, C], no bias
  std::shared_ptr<GroupedExperts> experts;
  std::shared_ptr<SwiGLUMLP> shared_experts;  // null without shared experts
  Tensor& expert_bias;  // [E] f32 buffer: bias balancing's selection offsets

  // Where the experts run (null: all here) and the ranks whose tokens are one
  // batch (data, context parallel: their loads are summed for balancing;
  // null: this rank's alone). Set by train::parallelize / ep/.
  std::shared_ptr<ExpertPlacement> placement;
  dist::ProcessGroupPtr batch_group;

  // The auxiliary balance loss of the last training forward, times
  // balance_coeff (aux_loss balancing; else undefined), handed over once.
  Tensor take_aux_loss();
  // Bias balancing, after an optimizer step: the loads routed since the last
  // update (summed over batch_group) move each expert's bias by
  // coeff * sign(mean load - load), the update's mean removed. Returns the loads.
  RoutingStats update_bias();
  // The (token, expert) pairs routed since the last update_bias or
  // reset_routing_stats, on this rank.
  const std::vector<int64_t>& routed() const { return routed_; }
  void reset_routing_stats();

 private:
  Tensor aux_loss_;
  std::vector<int64_t> routed_;
};

// The MoE layers of a model, in order (for balancing and statistics).
std::vector<MoE*> moe_layers(Module& model);
// The sum of the MoE layers' auxiliary losses of the last forward (undefined without any).
Tensor take_aux_losses(Module& model);
// update_bias on every bias-balanced layer; their loads (global), one per layer.
std::vector<RoutingStats> update_expert_biases(Module& model);

}  // namespace tessera::nn
