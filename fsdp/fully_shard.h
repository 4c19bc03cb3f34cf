// fully_shard: FSDP2 in C++ (PyTorch: torch.distributed.fsdp.fully_shard).
//
//   auto mesh = init_device_mesh("cpu", {dist::world_size()}, {"dp"});
//   for (auto& block : model->blocks) fsdp::fully_shard(*block, {.mesh = mesh});
//   fsdp::fully_shard(*model, {.mesh = mesh});
//
// Composable: no wrapper; the module keeps its type and parameter names, and
// its parameter slots hold sharded DTensors (the optimizer steps on those).
// Apply it bottom-up: each call forms one parameter group from the module's
// parameters not already in a group. Calling the module as module(x) runs the
// hooks that gather and free parameters and reduce gradients; module.forward(x)
// does not. PyTorch's FSDPModule methods are free functions here, taking the
// module.
#pragma once

#include "fsdp/fsdp_state.h"

namespace tessera::fsdp {

nn::Module& fully_shard(nn::Module& module, const FullyShardOptions& options = {});

// The module's FSDP state; throws when fully_shard was not applied to it.
FSDPState& fsdp_state(nn::Module& module);
// Whether fully_shard was applied to `module` itself.
bool is_fully_sharded(nn::Module& module);

// A pending unshard from unshard(module, true).
class UnshardHandle {
 public:
  UnshardHandle() = default;
  explicit UnshardHandle(FSDPParamGroup* group) : group_(group) {}
  void wait();

 private:
  FSDPParamGroup* group_ = nullptr;
};

// All-gathers the module's group (not its children). With async_op the
// collective is issued and the handle waits for it (the module's pre-forward
// also waits for it); without, it waits before returning.
UnshardHandle unshard(nn::Module& module, bool async_op = false);
// Frees the module's unsharded parameters and registers the sharded ones.
void reshard(nn::Module& module);

// Gradient accumulation and control. `recurse` applies to every FSDP module
// inside `module` (PyTorch's default); otherwise only to `module`.
void set_requires_gradient_sync(nn::Module& module, bool sync, bool recurse = true);
void set_requires_all_reduce(nn::Module& module, bool all_reduce, bool recurse = true);
void set_reshard_after_forward(nn::Module& module, bool reshard, bool recurse = true);
void set_reshard_after_backward(nn::Module& module, bool reshard, bool recurse = true);
void set_is_last_backward(nn::Module& module, bool last);
// Root only: now, for every FSDP group under the root, what a gradient-
// synchronizing backward's post-backward does: the gradients accumulated
// unsharded over no-sync backwards reduce-scattered (and all-reduced over
// HSDP's replicas) into the sharded parameters' .grad, group by group in the
// order a backward reaches them, and waited for. The parameters stay
// unsharded (reshard() frees them). A pipeline's REDUCE_GRAD (pp/pipeline.h):
// one reduction after the last micro-batch's backward, as PyTorch's stage.
void reduce_gradients(nn::Module& root);
void set_gradient_divide_factor(nn::Module& module, double factor);
void set_unshard_in_backward(nn::Module& module, bool unshard);
void set_modules_to_forward_prefetch(nn::Module& module, const std::vector<nn::Module*>& targets);
void set_modules_to_backward_prefetch(nn::Module& module, const std::vector<nn::Module*>& targets);
// Root only: after an exception thrown mid forward/backward, waits for
// in-flight collectives, reshards every group, drops in-flight gradients and
// per-iteration state, and clears the autograd tape, so the next iteration
// trains correctly.
void reset_iter_state(nn::Module& root);

// Turns implicit forward prefetch and default backward prefetch off (or back
// on) for the whole root (not in PyTorch; for measuring what prefetch buys).
// Any time, also before the first forward (tessera-train's parallelism.prefetch).
void set_prefetch(nn::Module& root, bool enabled);

// register_fsdp_forward_method: runs `method` (another entry point of the
// module, e.g. generate) with the module's FSDP hooks around it.
TensorList call_with_fsdp_hooks(nn::Module& module, TensorList inputs,
                                const std::function<TensorList(const TensorList&)>& method);
// PyTorch patches the method onto the module; C++ cannot, so this returns the
// method wrapped in the module's FSDP hooks: call the result instead.
std::function<TensorList(TensorList)> register_fsdp_forward_method(
    nn::Module& module, std::function<TensorList(const TensorList&)> method);

}  // namespace tessera::fsdp
