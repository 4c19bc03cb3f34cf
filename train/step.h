// One training step of a language model: its micro-batches' forward and
// backward passes, the loss averaged over micro-batches and ranks, gradient
// clipping and the optimizer's update. What tessera-train's loop calls each
// step; the planner runs the same on the meta device.
#pragma once

#include <functional>
#include <utility>

#include "nn/models.h"
#include "nn/moe.h"
#include "nn/optim.h"
#include "runtime/distributed.h"

namespace tessera::train {

// Micro-batch m's (inputs, targets) on the model's device: whole sequences
// (under context parallelism every rank of a cp group gets the same, and
// forward_backward takes the rank's slice).
using BatchFn = std::function<std::pair<Tensor, Tensor>(int64_t micro_batch)>;

// The mean cross-entropy of `model` on whole sequences x -> y. Under context
// parallelism (the model has a sequence shard) this rank's slice of them,
// weighed so that the mean over the cp group's ranks is the batch's mean.
Tensor loss(nn::LanguageModel& model, const Tensor& x, const Tensor& y);

// The forward and backward passes of one optimizer step: grad_accum
// micro-batches, each loss scaled by 1 / grad_accum, gradients reduced after
// the last. An MoE model's auxiliary balance losses join each backward but
// not the returned sum of the micro-batches' cross-entropies (f64, on the
// device, not read: no host sync).
Tensor forward_backward(nn::LanguageModel& model, int64_t grad_accum, const BatchFn& batch);

struct StepOptions {
  int64_t grad_accum = 1;  // micro-batches per step
  double max_norm = 1.0;   // gradient clipping (0: off; the norm is still computed)
};
struct StepResult {
  Tensor loss;       // the mean over micro-batches and `loss_group`'s ranks: f64 [1], on the device
  Tensor grad_norm;  // the total gradient norm before clipping (0-dim, on the device)
  // Per MoE layer, the (token, expert) pairs it routed this step, summed over
  // its batch group; bias balancing has moved its expert biases by them.
  std::vector<nn::RoutingStats> routing;
};
// Sets the learning rate, runs forward_backward, averages the loss over the
// ranks of `loss_group` (null or one rank: none), clips, steps and zeroes the
// gradients, then moves the expert biases of bias-balanced MoE layers
// (nn::update_expert_biases). Nothing is read on the host, except an MoE
// layer's routing (its top-k choice runs there).
StepResult train_step(nn::LanguageModel& model, optim::Optimizer& optimizer, double lr, const StepOptions& options,
                      const BatchFn& batch, const dist::ProcessGroupPtr& loss_group);

}  // namespace tessera::train
