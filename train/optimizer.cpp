#include "train/optimizer.h"

namespace tessera::train {

std::unique_ptr<optim::Optimizer> make_optimizer(nn::LanguageModel& model, const OptimizerOptions& o,
                                                 optim::AdamW** adamw) {
  TS_CHECK(o.name == "adamw" || o.name == "sgd", "optimizer: expected adamw or sgd, got '{}'", o.name);
  if (adamw != nullptr) *adamw = nullptr;
  if (o.name == "sgd")
    return std::make_unique<optim::SGD>(
        model.parameters(), optim::SGDOptions{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay});
  // Weight decay on matrices only (nanoGPT's grouping).
  TensorList decay, no_decay;
  for (auto& [name, p] : model.named_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto opt = std::make_unique<optim::AdamW>(
      std::vector<optim::ParamGroup>{{decay, o.lr, o.weight_decay}, {no_decay, o.lr, 0.0}},
      optim::AdamWOptions{.lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps});
  if (adamw != nullptr) *adamw = opt.get();
  return opt;
}

optim::LRSchedule make_schedule(const ScheduleOptions& s, double lr, int64_t steps) {
  return {.kind = optim::schedule_kind(s.name),
          .max_lr = lr,
          .min_lr = lr * s.min_lr_ratio,
          .warmup = s.warmup_steps,
          .total = s.decay_steps > 0 ? s.decay_steps : steps,
          .decay_ratio = s.decay_ratio};
}

}  // namespace tessera::train
