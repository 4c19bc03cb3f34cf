// Autograd is a tape. With grad mode on, every op whose inputs require grad
// appends a Node (its backward function and what it saved) to the current
// thread's tape. backward() walks the tape from the end to the start: gradient
// flow is a plain reverse loop. Markers are nodes that run a callback when the
// walk reaches them; FSDP's pre-/post-backward hooks are markers, and its
// end-of-backward work is a queued callback.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace tessera::autograd {

// ---- grad mode ----------------------------------------------------------------
bool is_grad_enabled();
void set_grad_enabled(bool enabled);

// Disables recording for its scope (like torch.no_grad()).
class NoGradGuard {
 public:
  NoGradGuard() : prev_(is_grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(is_grad_enabled()) { set_grad_enabled(true); }
  ~EnableGradGuard() { set_grad_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

// Computes one gradient per input of the op (undefined where an input needs none)
// from one gradient per output (never undefined: missing ones are zero-filled).
using BackwardFn = std::function<TensorList(const TensorList& grad_outputs)>;
// The same for the inputs marked in `want` only (the others undefined): an op
// that has one (linear, matmul) computes its input's gradient and its
// weight's apart, which a split backward (backward_input) needs.
using BackwardSomeFn = std::function<TensorList(const TensorList& grad_outputs, const std::vector<bool>& want)>;

// One entry of the tape.
struct Node {
  std::string name;
  std::string backward_name;  // "<name>.backward", for the profiler
  struct Input {
    uint64_t id = 0;                   // the input tensor's identity
    bool needs_grad = false;           // requires grad at record time
    std::shared_ptr<TensorImpl> leaf;  // set for leaves: where .grad accumulates
  };
  std::vector<Input> inputs;
  std::vector<uint64_t> output_ids;
  std::vector<std::weak_ptr<TensorImpl>> outputs;  // for retain_grad on non-leaves
  // Gradient hooks of output k (register_hook on a non-leaf). They live on the
  // node, as PyTorch's live on grad_fn, so they fire even after the tensor
  // itself is gone (a module output consumed by the next layer).
  std::vector<std::vector<std::function<Tensor(const Tensor&)>>> output_hooks;
  std::vector<Shape> output_shapes;
  std::vector<DType> output_dtypes;
  std::vector<Device> output_devices;
  BackwardFn backward;
  BackwardSomeFn backward_some;  // optional

  // Markers only: the callback, and the tensors whose gradient must exist for it
  // to fire (empty: always fires when reached).
  std::function<void()> marker;
  std::vector<uint64_t> watch_ids;
  bool is_marker() const { return static_cast<bool>(marker); }
};

class Tape {
 public:
  std::vector<std::unique_ptr<Node>>& nodes() { return nodes_; }
  size_t size() const { return nodes_.size(); }
  void clear() { nodes_.clear(); }

 private:
  std::vector<std::unique_ptr<Node>> nodes_;
};

// The tape ops record onto (per thread). Checkpointing swaps in a nested tape.
Tape& current_tape();
// Makes `tape` current for its scope.
class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* prev_;
};

// ---- recording ------------------------------------------------------------------
bool any_requires_grad(const TensorList& tensors);
// True when an op on these inputs should be recorded (grad mode on, some input requires grad).
bool should_record(const TensorList& inputs);
// Appends a node and marks the outputs as non-leaf tensors that require grad.
// Callers check should_record first.
void record(const char* name, const TensorList& inputs, const TensorList& outputs,
            BackwardFn backward, BackwardSomeFn backward_some = nullptr);
// Appends a marker (in grad mode only, like an op). With `watch` non-empty it
// fires only when one of those tensors received a gradient in this backward.
void record_marker(const std::string& name, std::function<void()> callback,
                   const TensorList& watch = {});
// During backward: runs `callback` after the walk ends (outermost backward).
// Outside backward: throws.
void queue_callback(std::function<void()> callback);
bool in_backward();
// The backward running: each backward() (outermost) and backward_input()
// starts a new one, and a backward_weight() continues its backward_input's,
// so work queued once per backward (FSDP's final callback) is queued once
// for each of several split backwards in flight. 0 outside backward.
uint64_t backward_pass_id();

// ---- running backward --------------------------------------------------------------
// Accumulates d(root)/d(leaf) into every leaf's .grad. `grad` defaults to 1
// for a one-element root. Consumes the tape (the graph is freed afterwards).
void backward(const Tensor& root, const Tensor& grad = {});
// The same for several roots with their gradients.
void backward(const TensorList& roots, const TensorList& grads);
void clear_tape();
size_t tape_size();

// ---- a backward in two parts (zero-bubble pipeline schedules) ---------------------------
// backward_input walks the tape as backward() does, but computes only what the
// gradients of non-leaf tensors and of the leaves `inputs` need (a pipeline
// stage's input, whose gradient is sent on at once). The rest is returned, to
// run later with backward_weight in the order the walk met it: an op's
// gradients for the other leaves (the parameters; the whole op when it feeds
// only such leaves, the weight's and bias's part of an op with a
// BackwardSomeFn, as linear and matmul), the markers that watch nothing
// (FSDP's post-backward), those leaves' accumulation into .grad and the
// callbacks queued. Together the two compute what backward() computes, each
// gradient by the same operations. Ops without a BackwardSomeFn that feed a
// parameter and another tensor compute both in backward_input.
class WeightGradients;
std::shared_ptr<WeightGradients> backward_input(const TensorList& roots, const TensorList& grads,
                                                const TensorList& inputs = {});
// Runs what backward_input deferred (once).
void backward_weight(WeightGradients& deferred);

// ---- tensor-level helpers -----------------------------------------------------------
// A new tensor over the same bytes that does not require grad.
Tensor detach(const Tensor& x);
// Keeps .grad on a non-leaf tensor after backward.
void retain_grad(const Tensor& x);
// hook(grad) runs when x's gradient is complete; it may return a replacement
// (or an undefined tensor to keep the gradient). On a non-leaf the hook is
// kept by the tape node that produced x (it fires even after x is gone); if
// that node is not on the current tape (registered during backward, or inside
// a checkpoint recompute for an outer tensor) it is kept by x itself and fires
// only while x lives, after the node's hooks.
void register_hook(const Tensor& x, std::function<Tensor(const Tensor&)> hook);
// Runs after a leaf's .grad was accumulated (optimizer-in-backward style).
void register_post_accumulate_grad_hook(const Tensor& x, std::function<void(const Tensor&)> hook);

// ---- activation checkpointing ----------------------------------------------------------
// Runs fn(inputs) without saving its activations; during backward re-runs it on
// a nested tape (same RNG state) and back-propagates through the recomputation.
//
// With save_matmuls (selective checkpointing's per-op policy, TorchTitan's
// "op" option) the matrix products' and attention's outputs of the first run
// are kept, and the recomputation takes them back instead of computing them
// again: only the pointwise ops and the norms run twice. The kept outputs are
// the ones a recomputation would give, so the gradients are the same bits.
struct CheckpointPolicy {
  bool save_matmuls = false;
};
using SegmentFn = std::function<TensorList(const TensorList&)>;
TensorList checkpoint(const SegmentFn& fn, const TensorList& inputs, CheckpointPolicy policy = {});

// The kept outputs of the segment running now (null outside a save_matmuls
// segment): linear and attention stash theirs in its first run and take them
// back, in the same order, in its recomputation.
class SavedOutputs {
 public:
  bool replaying() const { return replay_; }
  void stash(TensorList outputs) { saved_.push_back(std::move(outputs)); }
  TensorList take(const char* op);
  void start_replay() { replay_ = true, next_ = 0; }
  size_t size() const { return saved_.size(); }

 private:
  std::vector<TensorList> saved_;
  size_t next_ = 0;
  bool replay_ = false;
};
SavedOutputs* saved_outputs();

}  // namespace tessera::autograd
