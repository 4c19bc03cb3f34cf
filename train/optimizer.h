// An optimizer and learning-rate schedule for a language model, from plain
// options: AdamW with weight decay on matrices only (nanoGPT's grouping), or
// SGD with momentum; warmup then cosine, linear, constant or
// warmup-stable-decay.
#pragma once

#include <memory>
#include <string>

#include "nn/models.h"
#include "nn/optim.h"

namespace tessera::train {

struct OptimizerOptions {
  std::string name = "adamw";  // adamw | sgd
  double lr = 2e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // matrices only (AdamW); every parameter (SGD)
  double momentum = 0.9;      // sgd
};

// The optimizer over the model's (sharded) parameters; `adamw` is set to the
// AdamW when that is the choice (its state goes into checkpoints).
std::unique_ptr<optim::Optimizer> make_optimizer(nn::LanguageModel& model, const OptimizerOptions& options,
                                                 optim::AdamW** adamw = nullptr);

struct ScheduleOptions {
  std::string name = "cosine";  // cosine | linear | constant | wsd
  int64_t warmup_steps = 60;
  double min_lr_ratio = 0.1;  // the decay ends at lr * min_lr_ratio
  int64_t decay_steps = 0;    // where the decay ends (0: at the run's last step)
  double decay_ratio = 0.2;   // wsd: the share of the steps after warmup spent decaying
};
// The schedule from lr for a run of `steps` steps; throws naming a bad name.
optim::LRSchedule make_schedule(const ScheduleOptions& options, double lr, int64_t steps);

}  // namespace tessera::train
