// FSDPState: the hooks of one fully_shard call and the root logic (PyTorch:
// _fsdp_state.py). How the hooks map onto the autograd tape:
//
//   pre-forward hook   unshard (all-gather) this group, prefetch the next one,
//                      and record a PostBackward marker before the module's ops
//   post-forward hook  reshard per reshard_after_forward, and record a
//                      PreBackward marker after the module's ops (it fires only
//                      when one of the module's outputs received a gradient)
//   backward walk      PreBackward: unshard again (prefetch the group before it);
//                      the module's ops; PostBackward: reduce-scatter its gradients
//   end of backward    the root's queued callback: run post-backward for groups
//                      the walk did not reach, wait for reductions, reshard all
#pragma once

#include <memory>
#include <optional>

#include "fsdp/fsdp_param_group.h"

namespace tessera::fsdp {

class FSDPState;

// Shared by every state under one root (PyTorch: FSDPStateContext).
struct FSDPStateContext {
  std::vector<FSDPState*> all_states;  // pre-order from the root
  FSDPState* root = nullptr;
  FSDPState* iter_forward_root = nullptr;
  // The backward (autograd::backward_pass_id) whose final callback is queued;
  // 0: none. Split backwards of several micro-batches (a zero-bubble
  // pipeline) each queue their own.
  uint64_t post_backward_final_callback_pass = 0;
  bool is_last_backward = true;
};

class FSDPState final : public nn::ModuleExtension {
 public:
  FSDPState(nn::Module& module, std::unique_ptr<FSDPParamGroup> group, MixedPrecisionPolicy mp, bool raf_set_by_user);

  nn::Module& module;
  std::unique_ptr<FSDPParamGroup> param_group;  // null for a module without parameters of its own
  std::optional<bool> is_root;
  std::string fqn;  // the module's name under the root
  std::shared_ptr<FSDPStateContext> state_ctx;
  std::shared_ptr<FSDPCommContext> comm_ctx;
  TrainingState training_state = TrainingState::Idle;
  MixedPrecisionPolicy mp_policy;
  bool raf_set_by_user;
  // set_prefetch on the root before its first forward: applied at lazy init.
  bool prefetch_enabled = true;
  // Explicit prefetch targets (set_modules_to_forward/backward_prefetch).
  std::vector<FSDPState*> forward_prefetch;
  std::vector<FSDPState*> backward_prefetch;
  bool explicit_forward_prefetch = false;

  void pre_forward(TensorList& args);
  void post_forward(TensorList& outputs);
  void pre_backward();
  void root_post_backward_final_callback();
  // Decides the root (the first state to run forward) and shares contexts.
  void lazy_init();

  // ModuleExtension: reshard before moves and state dicts, re-pad after.
  void before_move(nn::Module&) override;
  void after_move(nn::Module&) override;
  void before_state_dict(nn::Module&) override;
  void after_load_state_dict(nn::Module&) override;

 private:
  void reshard_for_io();
};

// The FSDP state attached by fully_shard, or null.
FSDPState* state_of(nn::Module& module);

}  // namespace tessera::fsdp
