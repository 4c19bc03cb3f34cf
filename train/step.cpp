#include "train/step.h"

#include "autograd/tape.h"
#include "fsdp/fully_shard.h"
#include "nn/moe.h"
#include "runtime/stream.h"

namespace tessera::train {

Tensor loss(nn::LanguageModel& model, const Tensor& x, const Tensor& y) {
  const auto& slices = model.sequence_shard();
  if (!slices) return model.loss(x, y);
  // Context parallelism: this rank's slice of the sequences, its loss
  // weighed so that the mean over the slices is the sequences' mean.
  auto [xs, ys] = slices->shard_batch(x, y);
  return slices->weigh_loss(model.loss(xs, ys));
}

Tensor forward_backward(nn::LanguageModel& model, int64_t grad_accum, const BatchFn& batch) {
  TS_CHECK(grad_accum >= 1, "forward_backward: grad_accum must be >= 1, got {}", grad_accum);
  Tensor loss_sum;
  for (int64_t m = 0; m < grad_accum; ++m) {
    // Gradients are reduced once, after the last micro-batch.
    fsdp::set_requires_gradient_sync(model, m + 1 == grad_accum);
    auto [x, y] = batch(m);
    Tensor loss = train::loss(model, x, y);
    if (!loss_sum.defined()) loss_sum = zeros({}, DType::F64, loss.device());
    loss_sum = ops::add(loss_sum, ops::to(loss, DType::F64));
    // Mixtures of experts: their balance losses join the gradient, not the reported loss.
    Tensor aux = nn::take_aux_losses(model);
    if (aux.defined()) loss = loss + to(aux, loss.dtype());
    autograd::backward(loss * (1.0 / static_cast<double>(grad_accum)));
  }
  return loss_sum;
}

StepResult train_step(nn::LanguageModel& model, optim::Optimizer& optimizer, double lr, const StepOptions& o,
                      const BatchFn& batch, const dist::ProcessGroupPtr& loss_group) {
  optimizer.set_lr(lr);
  Tensor loss_sum = forward_backward(model, o.grad_accum, batch);
  Tensor mean = ops::reshape(ops::binary(ops::BinaryOp::Div, loss_sum, static_cast<double>(o.grad_accum)), {1});
  const int ranks = loss_group ? loss_group->size() : 1;
  if (ranks > 1) loss_group->all_reduce(mean, {dist::ReduceOp::Sum})->wait(current_stream(mean.device()));
  StepResult r;
  r.loss = ops::binary(ops::BinaryOp::Div, mean, static_cast<double>(ranks));
  r.grad_norm = o.max_norm > 0 ? nn::clip_grad_norm_(model.parameters(), o.max_norm) : nn::grad_norm(model.parameters());
  optimizer.step();
  optimizer.zero_grad();
  r.routing = nn::update_expert_biases(model);
  return r;
}

}  // namespace tessera::train
