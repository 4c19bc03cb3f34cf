// FSDPParamGroup: one communication bucket's state machine (PyTorch:
// _fsdp_param_group.py). All parameters of one fully_shard call are gathered
// in one all-gather and reduced in one reduce-scatter.
//
//   training state:  IDLE -> FORWARD (pre_forward) -> IDLE (post_forward)
//                    -> PRE_BACKWARD (pre_backward) -> POST_BACKWARD (post_backward)
//                    -> IDLE (end-of-backward callback)
//   sharded state:   SHARDED <-> UNSHARDED (or SHARDED_POST_FORWARD for int
//                    reshard_after_forward)
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>

#include "fsdp/collectives.h"

namespace tessera::fsdp {

enum class TrainingState { Idle, Forward, PreBackward, PostBackward };
const char* training_state_name(TrainingState s);

class FSDPParamGroup;

// Shared by every group under one root (PyTorch: FSDPCommContext): streams,
// the buffers other streams still read, orders recorded in forward,
// reductions in flight, and an optional event log.
struct FSDPCommContext {
  FSDPStreams streams;  // created at the root's lazy init, on the mesh's device
  // The last forward all-gather buffer, until the next copy-in waited for its copy-out.
  std::optional<BufferState> all_gather_state;
  // The last reduce-scatter copy-in buffer, until the compute stream waited for its use.
  std::optional<BufferState> reduce_scatter_state;
  // The last gradient view-out: the compute stream waits for it at the end of backward.
  std::shared_ptr<Event> post_reduce_event;
  std::vector<FSDPParamGroup*> post_forward_order;  // this iteration, for backward prefetch
  std::vector<FSDPParamGroup*> forward_order;       // last iteration's pre-forward order (CPU forward prefetch)
  std::vector<FSDPParamGroup*> current_forward_order;
  std::deque<ReduceResult> reductions;  // gradient reductions not yet written
  // Implicit forward prefetch and default backward prefetch (off only to measure
  // what prefetching buys: fsdp::set_prefetch).
  bool prefetch = true;
  // Called for "unshard", "reshard", "post_backward" (tests assert event orders).
  std::function<void(const std::string& event, const std::string& fqn, TrainingState state)> on_event;
  void event(const char* what, const FSDPParamGroup& g);
  // Drops all_gather_state once the copy-in stream waited for its copy-out
  // (the next all-gather does it; the root's post-forward for the last one).
  void release_all_gather_state();
};

// Sets a group's training state for a scope and restores it (PyTorch:
// FSDPParamGroup.use_training_state), e.g. to unshard another group as a prefetch.
class TrainingStateGuard {
 public:
  TrainingStateGuard(FSDPParamGroup& group, TrainingState state);
  ~TrainingStateGuard();
  TrainingStateGuard(const TrainingStateGuard&) = delete;
  TrainingStateGuard& operator=(const TrainingStateGuard&) = delete;

 private:
  FSDPParamGroup& group_;
  TrainingState saved_;
};

class FSDPParamGroup {
 public:
  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, MeshInfo mesh_info, std::string fqn,
                 MixedPrecisionPolicy mp);

  const std::string fqn;  // the module's name in the model ("" for the root)
  std::vector<std::unique_ptr<FSDPParam>> fsdp_params;
  MeshInfo mesh_info;
  // Int reshard_after_forward: the k-rank groups forward keeps 1/k slices for.
  std::optional<MeshInfo> post_forward_mesh_info;
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;
  FSDPCommContext* comm_ctx = nullptr;

  TrainingState training_state = TrainingState::Idle;
  ShardedState sharded_state = ShardedState::Sharded;
  // Gradient controls (FSDPModule setters).
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool unshard_in_backward = true;
  std::optional<double> gradient_divide_factor;

  // Lazy init at the root's first forward: dtypes, meta check, re-padding.
  void lazy_init();
  bool lazily_initialized() const { return initialized_; }

  // Issues the group's all-gather (no-op when unsharded or already in flight).
  void unshard(bool async_op = false);
  // Completes a pending all-gather: copy-out (on the compute stream, which
  // waits for the all-gather) and register unsharded parameters.
  void wait_for_unshard();
  // Frees unsharded parameters per the current training state (see the header comment).
  void reshard();

  void pre_forward();
  void post_forward();
  void pre_backward(bool default_prefetch);
  void post_backward();
  // End of the last backward: complete every reduction, drop stale prefetches.
  void finalize_backward();
  // Recovery after an exception mid-iteration: wait, reshard, drop in-flight state.
  void reset_iter_state();

  std::vector<FSDPParam*> params() const;
  DType param_dtype() const;
  DType reduce_dtype() const;
  // For backward prefetch: this group's positions in post_forward_order.
  std::vector<size_t> post_forward_indices;

 private:
  std::vector<FSDPParam*> params_to_gather() const;
  const MeshInfo& gather_mesh() const;
  void to_sharded();
  void to_unsharded();
  void drain_reductions(size_t keep_in_flight);

  std::optional<AllGatherResult> all_gather_;
  Tensor partial_reduce_output_;  // HSDP: reduce-scatter outputs waiting for their all-reduce
  bool initialized_ = false;
};

}  // namespace tessera::fsdp
