// Activation checkpointing: the segment runs without saving activations; its
// backward re-runs it on a nested tape, with the generator state of the first
// run (so dropout masks match), and back-propagates through the recomputation.
#include "autograd/tape.h"
#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera::autograd {

namespace {
thread_local SavedOutputs* current_saved = nullptr;

// Makes `saved` the current segment's kept outputs for a scope (nested segments restore the outer).
struct SavedScope {
  SavedOutputs* previous;
  explicit SavedScope(SavedOutputs* saved) : previous(current_saved) { current_saved = saved; }
  ~SavedScope() { current_saved = previous; }
};
}  // namespace

SavedOutputs* saved_outputs() { return current_saved; }

TensorList SavedOutputs::take(const char* op) {
  TS_CHECK(next_ < saved_.size(),
           "checkpoint: the recomputation ran more products than the first run kept ({} kept; the {} after them): "
           "a checkpointed segment must run the same ops both times", saved_.size(), op);
  return saved_[next_++];
}

TensorList checkpoint(const SegmentFn& fn, const TensorList& inputs, CheckpointPolicy policy) {
  if (!is_grad_enabled()) return fn(inputs);
  Generator& gen = default_generator();
  uint64_t seed = gen.seed();
  int64_t offset = gen.offset();
  TensorList outputs;
  // Selective (per-op): the products' outputs of this run, taken back by the recomputation.
  auto saved = policy.save_matmuls ? std::make_shared<SavedOutputs>() : nullptr;
  {
    NoGradGuard no_grad;
    SavedScope keep(saved.get());
    outputs = fn(inputs);
  }
  TensorList float_outputs;
  for (Tensor& y : outputs) {
    if (!y.defined() || !is_floating(y.dtype())) continue;
    for (const Tensor& x : inputs)
      if (y.is_same(x)) y = ops::alias(y);  // an output must be a fresh tensor
    float_outputs.push_back(y);
  }
  // Recorded even when no input requires grad: parameters inside fn may.
  record("checkpoint", inputs, float_outputs,
         [fn, inputs, seed, offset, saved](const TensorList& grad_outputs) -> TensorList {
           Tape nested;
           TapeScope scope(nested);
           EnableGradGuard enable;
           TensorList detached;
           for (const Tensor& x : inputs) {
             Tensor d = x.defined() ? detach(x) : x;
             if (x.defined() && x.requires_grad()) d.set_requires_grad(true);
             detached.push_back(d);
           }
           Generator& g = default_generator();
           uint64_t saved_seed = g.seed();
           int64_t saved_offset = g.offset();
           g.manual_seed(seed);
           g.set_offset(offset);
           if (saved) saved->start_replay();
           TensorList recomputed;
           {
             SavedScope replay(saved.get());
             recomputed = fn(detached);
           }
           g.manual_seed(saved_seed);
           g.set_offset(saved_offset);
           TensorList roots, root_grads;
           size_t k = 0;
           for (const Tensor& y : recomputed) {
             if (!y.defined() || !is_floating(y.dtype())) continue;
             if (y.requires_grad()) {
               roots.push_back(y);
               root_grads.push_back(grad_outputs[k]);
             }
             ++k;
           }
           if (!roots.empty()) backward(roots, root_grads);
           nested.clear();
           TensorList input_grads;
           for (const Tensor& d : detached) input_grads.push_back(d.defined() ? d.grad() : Tensor());
           return input_grads;
         });
  return outputs;
}

}  // namespace tessera::autograd
