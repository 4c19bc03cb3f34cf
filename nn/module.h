// Module: named parameters and buffers (dotted FQNs), children, train/eval,
// dtype/device moves, initialisation, state dicts, and forward hooks.
//
// Parameters live in slots. A layer keeps a reference to its slot
// (`Tensor& weight = register_parameter(...)`) and reads it at every forward,
// so whoever replaces a slot's tensor (FSDP swapping sharded and unsharded
// parameters) changes what forward uses without the layer knowing.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "autograd/functions.h"

namespace tessera::nn {

// An ordered name -> tensor map (state dicts keep the module's order).
using StateDict = std::vector<std::pair<std::string, Tensor>>;
const Tensor* find_in(const StateDict& sd, const std::string& name);
// "a, b, c" for error messages, the first `max` names then "... (N more)".
std::string key_list(const std::vector<std::string>& keys, size_t max = 8);
// The same with each key in quotes ('a', 'b'), as missing and unexpected keys are listed: an empty
// name reads as '' rather than vanishing.
std::string quoted_keys(const std::vector<std::string>& keys, size_t max = 8);

class Module;
using ModulePtr = std::shared_ptr<Module>;

// Hooks a higher layer attaches to a module; FSDP's state implements them to
// reshard before a move or a state-dict call and to re-pad shards after.
class ModuleExtension {
 public:
  virtual ~ModuleExtension() = default;
  virtual void before_move(Module&) {}  // to(dtype), to_empty(device)
  virtual void after_move(Module&) {}
  virtual void before_state_dict(Module&) {}  // state_dict(), load_state_dict()
  virtual void after_load_state_dict(Module&) {}
};

// forward pre-hook: may change the inputs. forward hook: may change the outputs.
using ForwardPreHook = std::function<void(Module&, TensorList& inputs)>;
using ForwardHook = std::function<void(Module&, const TensorList& inputs, TensorList& outputs)>;

class Module {
 public:
  struct Slot {
    std::string name;
    Tensor value;
    bool persistent = true;  // buffers only: part of the state dict
  };

  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Calling a module runs its forward pre-hooks, forward, then its forward
  // hooks. Calling forward() directly runs no hooks (as in PyTorch).
  Tensor operator()(const Tensor& x);
  TensorList operator()(TensorList inputs);
  // Runs `body` in place of forward, with this module's hooks around it
  // (how FSDP's register_fsdp_forward_method calls another method).
  TensorList call_with_hooks(TensorList inputs,
                             const std::function<TensorList(const TensorList&)>& body);

  // Single-input modules override forward; multi-input ones forward_list.
  virtual Tensor forward(const Tensor& x);
  virtual TensorList forward_list(const TensorList& inputs);

  // Type name for printing and error messages ("Linear", "GPT", ...).
  virtual std::string type_name() const { return "Module"; }

  // ---- registration -----------------------------------------------------------
  Tensor& register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  Tensor& register_buffer(const std::string& name, Tensor value, bool persistent = true);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  // ---- access -----------------------------------------------------------------
  // Pre-order, deduplicated by identity (a tied parameter is listed once, under
  // its first name), like PyTorch. Virtual for a module whose parts are held
  // under other names (pp::PipelinedModel lists its stages' parameters by
  // their full model names).
  virtual std::vector<std::pair<std::string, Tensor>> named_parameters(bool recurse = true) const;
  TensorList parameters(bool recurse = true) const;
  std::vector<std::pair<std::string, Tensor>> named_buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, Module*>> named_modules(const std::string& prefix = "");
  const std::vector<std::pair<std::string, ModulePtr>>& named_children() const { return children_; }
  Module* child(const std::string& name) const;
  // Removes the child `name` (and everything under it) and returns it; the
  // other children keep their names, so a model with layers removed (a
  // pipeline stage's part) keeps the full model's FQNs. Throws when there is none.
  ModulePtr remove_child(const std::string& name);
  // The module at a dotted path ("transformer.h.0"); throws when there is none.
  Module& submodule(const std::string& path);
  // Every slot of this module (not children), parameters then buffers.
  std::deque<Slot>& parameter_slots() { return params_; }
  std::deque<Slot>& buffer_slots() { return buffers_; }
  Slot* find_parameter_slot(const std::string& name);

  // ---- modes and moves -------------------------------------------------------------
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  void apply(const std::function<void(Module&)>& fn);  // children first, then this
  // Converts floating parameters and buffers to dtype (requires_grad kept).
  virtual void to(DType dtype);
  // Gives every parameter and buffer fresh uninitialised storage on device
  // (materialises a model built on meta).
  virtual void to_empty(Device device);
  // Initialises every parameter from (seed, its FQN): the same values at any
  // world size and in any construction order.
  void init_weights(uint64_t seed);
  // Sets this module's own parameters; `prefix` is its FQN with a trailing dot.
  virtual void reset_parameters(uint64_t seed, const std::string& prefix);
  void zero_grad(bool set_to_none = true);

  // ---- state dicts --------------------------------------------------------------------
  // Every parameter and persistent buffer by FQN (tied parameters appear under
  // each name). The tensors are the module's own (no copy).
  virtual StateDict state_dict();
  // Copies values in place. strict: missing or unexpected keys are errors.
  // Shape mismatches are always errors; dtypes are converted.
  virtual void load_state_dict(const StateDict& state, bool strict = true);

  // ---- hooks -------------------------------------------------------------------------
  using HookId = uint64_t;
  HookId register_forward_pre_hook(ForwardPreHook hook, bool prepend = false);
  HookId register_forward_hook(ForwardHook hook, bool prepend = false);
  void remove_hook(HookId id);
  // Whether calling this module runs hooks (a forward that bypasses
  // operator() for a fused path must not skip them).
  bool has_forward_hooks() const { return !pre_hooks_.empty() || !post_hooks_.empty(); }

  // State attached by a higher layer (FSDP keeps its state here).
  std::shared_ptr<ModuleExtension> extension;

 protected:
  void add_child(const std::string& name, ModulePtr module);

 private:
  std::deque<Slot> params_;
  std::deque<Slot> buffers_;
  std::vector<std::pair<std::string, ModulePtr>> children_;
  std::unordered_map<std::string, size_t> child_index_;  // name -> position in children_
  std::vector<std::pair<HookId, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<HookId, ForwardHook>> post_hooks_;
  HookId next_hook_ = 1;
  bool training_ = true;
};

// A module that only holds children (nanoGPT's `transformer` ModuleDict).
class ModuleDict : public Module {
 public:
  std::string type_name() const override { return "ModuleDict"; }
};

// Children named "0", "1", ...; iterable.
class ModuleList : public Module {
 public:
  void push_back(ModulePtr m);
  size_t size() const { return named_children().size(); }
  Module& operator[](size_t i) const { return *named_children().at(i).second; }
  std::string type_name() const override { return "ModuleList"; }
};

}  // namespace tessera::nn
