#include "autograd/tape.h"

#include <unordered_map>
#include <unordered_set>

#include "runtime/op_call.h"
#include "runtime/ops.h"
#include "runtime/profiler.h"
#include "runtime/random.h"

namespace tessera::autograd {

namespace {

struct ThreadState {
  bool grad_enabled = true;
  Tape default_tape;
  Tape* current = &default_tape;
  int backward_depth = 0;
  std::vector<std::function<void()>> callbacks;
  uint64_t pass_id = 0;    // the outermost backward running (backward_pass_id)
  uint64_t last_pass = 0;  // the last id given
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

// True when nothing else refers to t's impl or bytes, so it may be updated in place.
bool uniquely_owned(const Tensor& t) {
  return t.impl_ptr().use_count() == 1 && !t.is_subclass() && t.storage().use_count() == 1 &&
         t.is_contiguous();
}

void accumulate(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) {
    slot = g;
  } else if (uniquely_owned(slot) && slot.dtype() == g.dtype()) {
    ops::add_(slot, g);
  } else {
    slot = ops::add(slot, g);
  }
}

// Adds g into a leaf's .grad, running its hooks first and its post-accumulate hooks after.
void accumulate_into_leaf(const std::shared_ptr<TensorImpl>& impl, Tensor g) {
  Tensor leaf(impl);
  AutogradMeta& meta = leaf.autograd_meta();
  // A subclass parameter's gradient takes the parameter's layout first (for
  // a DTensor: a partial sum of a replicated parameter, such as a
  // sequence-parallel norm's weight, is reduced here, once per backward).
  if (leaf.is_subclass() && g.is_subclass()) g = intercept_one({OpId::gradient_layout, "gradient layout", {g, leaf}});
  for (auto& hook : meta.hooks) {
    Tensor r = hook(g);
    if (r.defined()) g = r;
  }
  TS_CHECK(g.dtype() == leaf.dtype() && g.shape() == leaf.shape(),
           "backward: gradient {} {} does not match leaf {} {}", shape_str(g.shape()),
           dtype_name(g.dtype()), shape_str(leaf.shape()), dtype_name(leaf.dtype()));
  if (meta.grad == nullptr) {
    // The new .grad must not alias another tensor the user can reach.
    meta.grad = (uniquely_owned(g) ? g : ops::clone(g)).impl_ptr();
  } else {
    Tensor existing(meta.grad);
    ops::add_(existing, g);
  }
  for (auto& hook : meta.post_accumulate_grad_hooks) hook(leaf);
}

}  // namespace

bool is_grad_enabled() { return state().grad_enabled; }
void set_grad_enabled(bool enabled) { state().grad_enabled = enabled; }

Tape& current_tape() { return *state().current; }

TapeScope::TapeScope(Tape& tape) : prev_(state().current) { state().current = &tape; }
TapeScope::~TapeScope() { state().current = prev_; }

bool any_requires_grad(const TensorList& tensors) {
  for (const Tensor& t : tensors)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

bool should_record(const TensorList& inputs) {
  return is_grad_enabled() && any_requires_grad(inputs);
}

void record(const char* name, const TensorList& inputs, const TensorList& outputs,
            BackwardFn backward, BackwardSomeFn backward_some) {
  auto node = std::make_unique<Node>();
  node->name = name;
  node->backward_name = node->name + ".backward";
  for (const Tensor& x : inputs) {
    Node::Input in;
    if (x.defined()) {
      in.id = x.impl()->id;
      in.needs_grad = x.requires_grad();
      if (in.needs_grad && x.is_leaf()) in.leaf = x.impl_ptr();
    }
    node->inputs.push_back(std::move(in));
  }
  for (const Tensor& y : outputs) {
    AutogradMeta& meta = y.autograd_meta();
    meta.requires_grad = true;
    meta.is_leaf = false;
    node->output_ids.push_back(y.impl()->id);
    node->outputs.push_back(y.impl_ptr());
    node->output_shapes.push_back(y.shape());
    node->output_dtypes.push_back(y.dtype());
    node->output_devices.push_back(y.device());
  }
  node->backward = std::move(backward);
  node->backward_some = std::move(backward_some);
  current_tape().nodes().push_back(std::move(node));
}

void record_marker(const std::string& name, std::function<void()> callback,
                   const TensorList& watch) {
  if (!is_grad_enabled()) return;  // like ops, markers are recorded only in grad mode
  auto node = std::make_unique<Node>();
  node->name = name;
  node->marker = std::move(callback);
  for (const Tensor& t : watch)
    if (t.defined()) node->watch_ids.push_back(t.impl()->id);
  current_tape().nodes().push_back(std::move(node));
}

bool in_backward() { return state().backward_depth > 0; }

uint64_t backward_pass_id() { return in_backward() ? state().pass_id : 0; }

void queue_callback(std::function<void()> callback) {
  TS_CHECK(in_backward(), "queue_callback: only possible while backward is running");
  state().callbacks.push_back(std::move(callback));
}

void clear_tape() { current_tape().clear(); }
size_t tape_size() { return current_tape().size(); }

void backward(const Tensor& root, const Tensor& grad) { backward(TensorList{root}, {grad}); }

namespace {

// One walk of the tape from the end to the start: the pending gradients of
// non-leaf tensors (by id) and of leaves, and the node after which each
// leaf's gradient is complete (its first use on the tape).
class BackwardPass {
 public:
  explicit BackwardPass(std::vector<std::unique_ptr<Node>> nodes) : nodes_(std::move(nodes)) {
    // Each leaf is flushed after its first use, in that node's input order:
    // the same order on every rank, which the collectives a flush may issue
    // (a DTensor gradient laid out as its parameter) need. (Ids, and hence a
    // hash map's order, differ between ranks.)
    flush_at_.resize(nodes_.size());
    std::unordered_set<uint64_t> seen;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      for (const auto& in : nodes_[i]->inputs)
        if (in.leaf && seen.insert(in.id).second) flush_at_[i].push_back(in.id);
      for (uint64_t id : nodes_[i]->output_ids) produced_.insert(id);
    }
  }

  // The roots' gradients (ones for one-element roots given none).
  void seed(const TensorList& roots, const TensorList& grads_in) {
    for (size_t r = 0; r < roots.size(); ++r) {
      const Tensor& root = roots[r];
      TS_CHECK(root.defined() && root.requires_grad(),
               "backward: tensor {} does not require grad and has no recorded history", r);
      Tensor g = grads_in[r];
      if (!g.defined()) {
        TS_CHECK(root.numel() == 1,
                 "backward: a gradient can be created implicitly only for one-element outputs, "
                 "got shape {}; pass grad",
                 shape_str(root.shape()));
        g = full(root.shape(), 1.0, root.dtype(), root.device());
      }
      TS_CHECK(g.shape() == root.shape(), "backward: gradient shape {} does not match output {}",
               shape_str(g.shape()), shape_str(root.shape()));
      TS_CHECK(root.is_leaf() || produced_.count(root.impl()->id) > 0,
               "backward: the graph that produced this tensor is not on the tape (already used by "
               "an earlier backward(), cleared, or recorded on another thread)");
      if (root.is_leaf()) {
        root_leaves_.push_back(root.impl()->id);
        auto& p = leaves_[root.impl()->id];
        p.impl = root.impl_ptr();
        accumulate(p.grad, g);
      } else {
        accumulate(grads_[root.impl()->id], g);
      }
    }
  }

  void run() {
    for (size_t i = nodes_.size(); i-- > 0;) {
      Node& node = *nodes_[i];
      if (node.is_marker()) {
        if (split_ && node.watch_ids.empty()) {
          deferred_.push_back({std::move(nodes_[i]), {}, 0, false});
          continue;
        }
        run_marker(node);
      } else {
        TensorList grad_outputs = take_output_grads(node);
        // Split: an op deferred lives on (in deferred_) until backward_weight.
        if (!grad_outputs.empty() && !(split_ && defer(nodes_[i], grad_outputs))) run_node(node, grad_outputs);
        for (uint64_t id : flush_at_[i]) {
          if (split_ && now_.count(id) == 0)
            deferred_.push_back({nullptr, {}, id, false});
          else
            flush_leaf(id);
        }
      }
      nodes_[i].reset();  // free what this op saved as soon as it is done
    }
    if (!split_) finish();
  }

  // Split mode (backward_input): leaves' gradients wait for run_deferred,
  // but those of `now` (a pipeline stage's input).
  void set_split(const TensorList& now) {
    split_ = true;
    for (const Tensor& t : now)
      if (t.defined()) now_.insert(t.impl()->id);
  }

  // What run() deferred, in the order it met it; then the roots that are leaves.
  void run_deferred() {
    for (Deferred& d : deferred_) {
      if (d.node && d.node->is_marker()) {
        run_marker(*d.node);
      } else if (d.node) {
        std::vector<bool> want;
        if (d.leaves_only)
          for (const auto& in : d.node->inputs) want.push_back(in.needs_grad && deferred_leaf(in));
        run_node(*d.node, d.grad_outputs, d.leaves_only ? &want : nullptr);
      } else {
        flush_leaf(d.leaf);
      }
      d = Deferred{};  // free what the op saved as soon as it is done
    }
    deferred_.clear();
    finish();
  }

 private:
  // One deferred item: an op (all of it, or its leaves' part), a marker, or a leaf's flush.
  struct Deferred {
    std::unique_ptr<Node> node;
    TensorList grad_outputs;
    uint64_t leaf = 0;
    bool leaves_only = false;
  };

  // Split mode: defers an op that feeds leaves: all of it when it feeds only
  // leaves, else its leaves' part where it can compute that apart (its
  // non-leaf inputs' gradients now). False: run it whole now.
  bool defer(std::unique_ptr<Node>& node, const TensorList& grad_outputs) {
    bool leaf = false, other = false;
    for (const auto& in : node->inputs) {
      if (!in.needs_grad) continue;
      (deferred_leaf(in) ? leaf : other) = true;
    }
    if (!leaf || (other && !node->backward_some)) return false;
    if (other) {
      std::vector<bool> want;
      for (const auto& in : node->inputs) want.push_back(in.needs_grad && !deferred_leaf(in));
      run_node(*node, grad_outputs, &want);
    }
    deferred_.push_back({std::move(node), grad_outputs, 0, other});
    return true;
  }

  // A leaf whose gradient a split backward defers (the parameters).
  bool deferred_leaf(const Node::Input& in) const { return in.leaf != nullptr && now_.count(in.id) == 0; }

  void finish() {
    for (uint64_t id : root_leaves_) flush_leaf(id);  // roots that are leaves, in the order given
    TS_ASSERT(leaves_.empty());
  }

  struct PendingLeaf {
    std::shared_ptr<TensorImpl> impl;
    Tensor grad;
  };

  // A marker fires when it watches nothing or a watched tensor got a gradient.
  void run_marker(Node& node) {
    bool fire = node.watch_ids.empty();
    for (uint64_t id : node.watch_ids) fire = fire || grads_.count(id) > 0;
    if (!fire) return;
    profiler::Scope scope(node.name.c_str());
    node.marker();
  }

  // The gradients of the node's outputs (empty when none reached it; zeros
  // for the outputs that got none), after their hooks and retain_grad.
  TensorList take_output_grads(Node& node) {
    TensorList grad_outputs(node.output_ids.size());
    bool any = false;
    for (size_t k = 0; k < node.output_ids.size(); ++k) {
      auto it = grads_.find(node.output_ids[k]);
      if (it == grads_.end()) continue;
      grad_outputs[k] = std::move(it->second);
      grads_.erase(it);
      any = true;
    }
    if (!any) return {};
    for (size_t k = 0; k < grad_outputs.size(); ++k) {
      if (!grad_outputs[k].defined()) {
        grad_outputs[k] = zeros(node.output_shapes[k], node.output_dtypes[k], node.output_devices[k]);
        continue;
      }
      if (k < node.output_hooks.size()) {
        for (auto& hook : node.output_hooks[k]) {
          Tensor r = hook(grad_outputs[k]);
          if (r.defined()) grad_outputs[k] = r;
        }
      }
      // Hooks registered off the tape, and retain_grad, of the (non-leaf) output if it is still alive.
      if (auto out = node.outputs[k].lock(); out && out->autograd) {
        for (auto& hook : out->autograd->hooks) {
          Tensor r = hook(grad_outputs[k]);
          if (r.defined()) grad_outputs[k] = r;
        }
        if (out->autograd->retains_grad) {
          Tensor slot = out->autograd->grad ? Tensor(out->autograd->grad) : Tensor();
          slot = slot.defined() ? ops::add(slot, grad_outputs[k]) : ops::clone(grad_outputs[k]);
          out->autograd->grad = slot.impl_ptr();
        }
      }
    }
    return grad_outputs;
  }

  // The node's backward (of the inputs in `want` only, when given), and its
  // input gradients routed to tensors and leaves.
  void run_node(Node& node, const TensorList& grad_outputs, const std::vector<bool>* want = nullptr) {
    TensorList input_grads;
    {
      profiler::Scope scope(node.backward_name.c_str());
      input_grads = want ? node.backward_some(grad_outputs, *want) : node.backward(grad_outputs);
    }
    TS_CHECK(input_grads.size() == node.inputs.size(), "backward of '{}' returned {} gradients for {} inputs",
             node.name, input_grads.size(), node.inputs.size());
    for (size_t j = 0; j < node.inputs.size(); ++j) {
      const Node::Input& in = node.inputs[j];
      if (!in.needs_grad || !input_grads[j].defined()) continue;
      if (in.leaf) {
        auto& p = leaves_[in.id];
        p.impl = in.leaf;
        accumulate(p.grad, input_grads[j]);
      } else {
        accumulate(grads_[in.id], input_grads[j]);
      }
    }
  }

  // A leaf's gradient is complete: accumulate it into .grad (and run its hooks).
  void flush_leaf(uint64_t id) {
    auto it = leaves_.find(id);
    if (it == leaves_.end()) return;
    PendingLeaf p = std::move(it->second);
    leaves_.erase(it);
    if (p.grad.defined()) accumulate_into_leaf(p.impl, std::move(p.grad));
  }

  std::vector<std::unique_ptr<Node>> nodes_;
  std::unordered_map<uint64_t, Tensor> grads_;  // pending gradients of non-leaf tensors
  std::unordered_map<uint64_t, PendingLeaf> leaves_;
  std::vector<std::vector<uint64_t>> flush_at_;
  std::vector<uint64_t> root_leaves_;
  std::unordered_set<uint64_t> produced_;
  bool split_ = false;
  std::unordered_set<uint64_t> now_;  // split: leaves whose gradients are not deferred
  std::vector<Deferred> deferred_;
};

// Callbacks may queue further callbacks; run until none are left.
void run_final_callbacks(ThreadState& st) {
  for (size_t k = 0; k < st.callbacks.size(); ++k) {
    auto cb = std::move(st.callbacks[k]);
    cb();
  }
  st.callbacks.clear();
}

}  // namespace

void backward(const TensorList& roots, const TensorList& grads_in) {
  TS_CHECK(roots.size() == grads_in.size(), "backward: {} roots but {} gradients", roots.size(),
           grads_in.size());
  ThreadState& st = state();
  // Take the graph: ops recorded from here on go to a fresh tape.
  BackwardPass pass(std::move(current_tape().nodes()));
  current_tape().clear();
  NoGradGuard no_grad;
  pass.seed(roots, grads_in);

  st.backward_depth++;
  if (st.backward_depth == 1) {
    st.callbacks.clear();
    st.pass_id = ++st.last_pass;
  }
  struct DepthGuard {
    ThreadState& s;
    ~DepthGuard() { s.backward_depth--; }
  } depth_guard{st};
  pass.run();
  if (st.backward_depth == 1) run_final_callbacks(st);
}

class WeightGradients {
 public:
  WeightGradients(std::vector<std::unique_ptr<Node>> nodes, const TensorList& now) : pass(std::move(nodes)) {
    pass.set_split(now);
  }
  BackwardPass pass;
  std::vector<std::function<void()>> callbacks;  // queued during backward_input
  uint64_t pass_id = 0;
  bool done = false;
};

std::shared_ptr<WeightGradients> backward_input(const TensorList& roots, const TensorList& grads_in,
                                                const TensorList& inputs) {
  TS_CHECK(roots.size() == grads_in.size(), "backward_input: {} roots but {} gradients", roots.size(),
           grads_in.size());
  ThreadState& st = state();
  TS_CHECK(st.backward_depth == 0, "backward_input: not inside another backward");
  auto deferred = std::make_shared<WeightGradients>(std::move(current_tape().nodes()), inputs);
  current_tape().clear();
  NoGradGuard no_grad;
  deferred->pass.seed(roots, grads_in);
  st.backward_depth++;
  st.callbacks.clear();
  deferred->pass_id = st.pass_id = ++st.last_pass;
  struct DepthGuard {
    ThreadState& s;
    ~DepthGuard() { s.backward_depth--; }
  } depth_guard{st};
  deferred->pass.run();
  deferred->callbacks = std::move(st.callbacks);
  st.callbacks.clear();
  return deferred;
}

void backward_weight(WeightGradients& deferred) {
  TS_CHECK(!deferred.done, "backward_weight: these weight gradients were already computed");
  ThreadState& st = state();
  TS_CHECK(st.backward_depth == 0, "backward_weight: not inside another backward");
  deferred.done = true;
  NoGradGuard no_grad;
  st.backward_depth++;
  st.callbacks = std::move(deferred.callbacks);
  st.pass_id = deferred.pass_id;
  struct DepthGuard {
    ThreadState& s;
    ~DepthGuard() { s.backward_depth--; }
  } depth_guard{st};
  deferred.pass.run_deferred();
  run_final_callbacks(st);
}

Tensor detach(const Tensor& x) {
  if (!x.defined()) return x;
  // A subclass tensor's detached alias is laid out as it is, over its pieces' aliases.
  if (x.is_subclass())
    return intercept_one({OpId::detach, "detach", {x}, {}, [](const TensorList& l) { return TensorList{ops::alias(l[0])}; }});
  return ops::alias(x);
}

void retain_grad(const Tensor& x) {
  TS_CHECK(x.requires_grad(), "retain_grad: the tensor does not require grad");
  if (!x.is_leaf()) x.autograd_meta().retains_grad = true;
}

void register_hook(const Tensor& x, std::function<Tensor(const Tensor&)> hook) {
  TS_CHECK(x.requires_grad(), "register_hook: cannot register a hook on a tensor that does not "
                              "require grad");
  if (!x.is_leaf()) {
    // On the node that produced x (the most recent one: search from the end).
    auto& nodes = current_tape().nodes();
    uint64_t id = x.impl()->id;
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      Node& node = **it;
      for (size_t k = 0; k < node.output_ids.size(); ++k) {
        if (node.output_ids[k] != id) continue;
        node.output_hooks.resize(node.output_ids.size());
        node.output_hooks[k].push_back(std::move(hook));
        return;
      }
    }
  }
  x.autograd_meta().hooks.push_back(std::move(hook));
}

void register_post_accumulate_grad_hook(const Tensor& x, std::function<void(const Tensor&)> hook) {
  TS_CHECK(x.requires_grad() && x.is_leaf(),
           "register_post_accumulate_grad_hook: only leaf tensors that require grad accumulate");
  x.autograd_meta().post_accumulate_grad_hooks.push_back(std::move(hook));
}

}  // namespace tessera::autograd
