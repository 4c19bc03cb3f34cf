// Expert parallelism: the experts of every MoE layer (nn/moe.h) split over
// the ranks of an "ep" group, each rank holding num_experts / ep of them
// (their weights DTensors Shard(0) on the group's mesh dim). Each rank routes
// its own tokens; the rows for an expert travel to its rank and the outputs
// back (GShard, TorchTitan's ExpertParallel):
//
//   counts    all_to_all of the rows per expert (ep x local experts i64)
//   dispatch  all_to_all_single of the rows, in runs per destination rank
//   experts   the received rows regrouped by local expert, one product each
//   combine   all_to_all_single back, in the order they came
//
// Backward runs the two exchanges in reverse, so a forward and backward
// issue 5 all-to-alls per MoE layer, EP 1 none. The dense parts are
// untouched (FSDP/HSDP shard them as before; train::parallelize).
#pragma once

#include <vector>

#include "dtensor/device_mesh.h"
#include "nn/moe.h"

namespace tessera::ep {

// x's rows [N, ...] exchanged over `group`: send_rows[p] consecutive rows
// to rank p, recv_rows[i] received from rank i, in rank order.
// Differentiable: the gradient goes back by the reverse exchange, traced as
// "<name> backward" on the "expert parallel" lane when `name` is given.
Tensor all_to_all_rows(const Tensor& x, const dist::ProcessGroupPtr& group, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, const char* name = nullptr);

// What one MoE layer exchanged, counted on this rank (every forward adds).
struct DispatchStats {
  int64_t exchanges = 0;   // forwards that dispatched
  int64_t rows_sent = 0;   // rows sent to other ranks (dispatch), the same number come back
  int64_t rows_kept = 0;   // rows for this rank's own experts
  int64_t max_rows = 0;    // the most rows this rank's experts received in one forward
};

class ExpertParallel final : public nn::ExpertPlacement {
 public:
  // Expert e of num_experts lives on group rank e / (num_experts / ep).
  ExpertParallel(dist::ProcessGroupPtr group, int64_t num_experts);
  Tensor run(const Tensor& x, const std::vector<int64_t>& counts, const LocalExperts& local) override;
  int64_t local_experts() const { return local_; }
  int64_t first_expert() const { return local_ * group_->rank(); }
  const dist::ProcessGroupPtr& group() const { return group_; }
  const DispatchStats& stats() const { return stats_; }

 private:
  dist::ProcessGroupPtr group_;
  int64_t experts_, local_;
  DispatchStats stats_;
};

// Splits the experts of every MoE layer of `model` over the 1-D mesh
// `ep_mesh` (its weights Shard(0); on meta, before to_empty, or already
// materialised, cut from rank 0's values) and sets each layer's placement
// and batch group (the ranks whose tokens make one batch, for balancing;
// null: ep_mesh's). Experts that do not divide over the ranks are refused,
// naming `experts_key` and `ep_key`.
void apply_expert_parallel(nn::Module& model, const MeshPtr& ep_mesh, const dist::ProcessGroupPtr& batch_group = nullptr,
                           const std::string& experts_key = "moe_experts", const std::string& ep_key = "ep");

}  // namespace tessera::ep
