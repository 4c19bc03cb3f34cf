// Optimizers (PyTorch semantics), learning-rate schedules and gradient clipping.
// Steps run under no-grad with the in-place ops of runtime/ops.h, one
// parameter at a time; on sharded (DTensor) parameters they update the local
// shards and issue no collectives.
#pragma once

#include <string>
#include <vector>

#include "nn/module.h"
#include "runtime/distributed.h"

namespace tessera::optim {

using nn::StateDict;

struct ParamGroup {
  TensorList params;
  double lr = 1e-3;
  double weight_decay = 0.0;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad(bool set_to_none = true);
  std::vector<ParamGroup>& param_groups() { return groups_; }
  void set_lr(double lr);  // every group

 protected:
  explicit Optimizer(std::vector<ParamGroup> groups);
  // Throws when a parameter's bytes were released (e.g. sharded by fully_shard after
  // this optimizer was built on it): stepping it would silently train nothing.
  void check_params() const;
  std::vector<ParamGroup> groups_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  // One pass per parameter through ops::adamw_ where the parameter, gradient
  // and moments allow it (as torch.optim.AdamW(fused=True)); the others, and
  // every parameter when false, take the unfused ops (8 passes and a temporary).
  bool fused = true;
};

// Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.
class AdamW : public Optimizer {
 public:
  AdamW(const TensorList& params, AdamWOptions options = {});
  // Groups keep their own lr and weight decay; the rest comes from options.
  AdamW(std::vector<ParamGroup> groups, AdamWOptions options);
  void step() override;

  struct State {
    int64_t step = 0;
    Tensor exp_avg, exp_avg_sq;  // created at the first step, like the parameter
  };
  // State of parameter j of group g.
  State& state(size_t group, size_t j) { return state_.at(group).at(j); }
  const AdamWOptions& options() const { return options_; }

  // The moments keyed by parameter name: "<fqn>.exp_avg", "<fqn>.exp_avg_sq"
  // (tensors like the parameter: sharded DTensors under FSDP, aliasing the
  // optimizer's own) and "<fqn>.step" (a 0-dim i64 copy). `named` maps the
  // optimizer's parameters to names (model.named_parameters()). Parameters
  // without moments yet (never stepped, no init_state) have no entries.
  StateDict state_dict(const std::vector<std::pair<std::string, Tensor>>& named) const;
  // Copies moments and steps in (values converted to each parameter's dtype);
  // missing entries leave a parameter's state fresh.
  void load_state_dict(const StateDict& state, const std::vector<std::pair<std::string, Tensor>>& named);
  // Creates zero moments for every parameter (the destinations a checkpoint loads into).
  void init_state();

 private:
  AdamWOptions options_;
  std::vector<std::vector<State>> state_;
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // coupled (added to the gradient), as torch.optim.SGD
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(const TensorList& params, SGDOptions options = {});
  void step() override;
  Tensor& momentum_buffer(size_t j) { return momentum_.at(j); }

 private:
  SGDOptions options_;
  std::vector<Tensor> momentum_;
};

// The learning rate of each step: a linear warmup from max_lr / warmup to
// max_lr over `warmup` steps, then by `kind` until step `total` (where the
// decay ends: nanoGPT's lr_decay_iters, which need not be the run's length),
// and min_lr from there on:
//   Cosine    half a cosine from max_lr down to min_lr
//   Linear    a straight line from max_lr down to min_lr
//   Constant  max_lr throughout (min_lr unused)
//   WSD       warmup-stable-decay: max_lr until the last decay_ratio of the
//             steps after warmup, then a straight line down to min_lr
struct LRSchedule {
  enum class Kind { Cosine, Linear, Constant, WSD };
  Kind kind = Kind::Cosine;
  double max_lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup = 0;
  int64_t total = 1;
  double decay_ratio = 0.2;  // WSD
  double lr_at(int64_t step) const;  // step counts from 0
  // E.g. "warmup 60 steps, then cosine to 2.00e-04 at step 600".
  std::string describe() const;
};
// "cosine" | "linear" | "constant" | "wsd"; throws naming the valid ones.
LRSchedule::Kind schedule_kind(const std::string& name);

}  // namespace tessera::optim

namespace tessera::nn {
// Scales gradients so their global L2 norm is at most max_norm; returns the
// norm before clipping as a 0-dim f64 tensor on the gradients' device (read
// it with .item() where a host sync is welcome, e.g. a log step). Sharded
// (DTensor) gradients take one all-reduce of the squared norm per mesh; one
// sum-of-squares kernel per group of tensors; no host sync off the CPU.
// `sum_over`: ranks holding other parameters of the same model (a
// pipeline's stages), whose squared norms are added in (one all-reduce).
Tensor clip_grad_norm_(const TensorList& params, double max_norm, const dist::ProcessGroupPtr& sum_over = nullptr);
// The global L2 norm of the gradients (no clipping), as above.
Tensor grad_norm(const TensorList& params, const dist::ProcessGroupPtr& sum_over = nullptr);
}  // namespace tessera::nn
