#include "fsdp/fsdp_state.h"

#include "autograd/functions.h"
#include "dtensor/dtensor.h"

namespace tessera::fsdp {

FSDPState* state_of(nn::Module& module) { return dynamic_cast<FSDPState*>(module.extension.get()); }

FSDPState::FSDPState(nn::Module& m, std::unique_ptr<FSDPParamGroup> group, MixedPrecisionPolicy mp, bool raf_set)
    : module(m), param_group(std::move(group)), mp_policy(mp), raf_set_by_user(raf_set) {}

void FSDPState::lazy_init() {
  if (is_root.has_value()) return;
  is_root = true;
  state_ctx = std::make_shared<FSDPStateContext>();
  comm_ctx = std::make_shared<FSDPCommContext>();
  comm_ctx->prefetch = prefetch_enabled;
  state_ctx->root = this;
  MeshPtr root_mesh = param_group ? param_group->mesh_info.mesh : nullptr;
  for (auto& [name, m] : module.named_modules()) {
    FSDPState* st = state_of(*m);
    if (st == nullptr) continue;
    if (st != this) {
      TS_CHECK(!st->is_root.has_value(),
               "FSDP requires running forward through the root module first: module '{}' was run on its own "
               "before the root",
               name);
      st->is_root = false;
    }
    st->fqn = name;
    st->state_ctx = state_ctx;
    st->comm_ctx = comm_ctx;
    if (st->param_group) {
      st->param_group->comm_ctx = comm_ctx.get();
      const_cast<std::string&>(st->param_group->fqn) = name;
      if (root_mesh == nullptr) root_mesh = st->param_group->mesh_info.mesh;
      // Groups may shard over different meshes of the job (an MoE block's
      // experts over the ranks that hold the same experts); one device.
      TS_CHECK(st->param_group->mesh_info.mesh->device_type() == root_mesh->device_type(),
               "fully_shard: module '{}' uses {} but the modules around it use {}; one root needs one device type",
               name, st->param_group->mesh_info.mesh->str(), root_mesh->str());
    }
    state_ctx->all_states.push_back(st);
  }
  // Unset reshard_after_forward means false for the root: its parameters are
  // the first needed in backward.
  if (param_group && !raf_set_by_user) {
    param_group->reshard_after_forward = false;
    param_group->post_forward_mesh_info.reset();
  }
  for (FSDPState* st : state_ctx->all_states)
    if (st->param_group) st->param_group->lazy_init();
}

namespace {
// Casts floating tensors to dtype (differentiably).
void cast_floating(TensorList& ts, DType dtype) {
  for (auto& t : ts)
    if (t.defined() && is_floating(t.dtype()) && t.dtype() != dtype) t = to(t, dtype);
}
}  // namespace

void FSDPState::pre_forward(TensorList& args) {
  if (training_state == TrainingState::PreBackward && autograd::in_backward()) {
    // Activation-checkpoint recompute during backward: only make sure the parameters are there.
    // (Outside a backward it is the next micro-batch's forward while a split
    // backward's weight half waits: a zero-bubble pipeline. That is a forward.)
    if (param_group) {
      param_group->unshard(/*async_op=*/true);
      param_group->wait_for_unshard();
    }
    return;
  }
  training_state = TrainingState::Forward;
  lazy_init();
  if (state_ctx->iter_forward_root == nullptr) {  // the first state of this forward pass
    state_ctx->iter_forward_root = this;
    comm_ctx->current_forward_order.clear();
    // The copy-in reads sharded parameters the optimizer (or a load) updated
    // on the compute stream (PyTorch: the all-gather streams wait for it here).
    for (FSDPState* st : state_ctx->all_states) {
      if (!st->param_group) continue;
      Device device = st->param_group->fsdp_params.front()->compute_device;
      comm_ctx->streams.init(device);
      comm_ctx->streams.all_gather_copy_in->wait_stream(current_stream(device));
      break;
    }
  }
  if (param_group && mp_policy.cast_forward_inputs && param_group->param_dtype() != param_group->fsdp_params.front()->orig_dtype)
    cast_floating(args, param_group->param_dtype());
  if (param_group) {
    param_group->pre_forward();
    // The tape may outlive the model: markers hold the state weakly.
    std::weak_ptr<nn::ModuleExtension> weak = module.extension;
    autograd::record_marker(fqn + " post_backward", [weak] {
      if (auto st = weak.lock()) static_cast<FSDPState*>(st.get())->param_group->post_backward();
    });
    comm_ctx->current_forward_order.push_back(param_group.get());
  }
  // Prefetch: explicit targets, or (CPU default) the group that ran after this one last iteration.
  if (explicit_forward_prefetch) {
    for (FSDPState* st : forward_prefetch) {
      if (!st->param_group) continue;
      TrainingStateGuard prefetching(*st->param_group, TrainingState::Forward);
      st->param_group->unshard(/*async_op=*/true);
    }
  } else if (param_group && comm_ctx->prefetch) {
    size_t position = comm_ctx->current_forward_order.size() - 1;
    const auto& order = comm_ctx->forward_order;
    if (position + 1 < order.size() && order[position] == param_group.get() && order[position + 1] != param_group.get()) {
      FSDPParamGroup* next = order[position + 1];
      TrainingStateGuard prefetching(*next, TrainingState::Forward);
      next->unshard(/*async_op=*/true);
    }
  }
}

void FSDPState::post_forward(TensorList& outputs) {
  // A recompute inside backward: the post-backward reshards.
  if (training_state == TrainingState::PreBackward && autograd::in_backward()) return;
  if (param_group) param_group->post_forward();
  if (autograd::is_grad_enabled()) {
    TensorList watch;
    for (const auto& t : outputs)
      if (t.defined() && t.requires_grad()) watch.push_back(t);
    std::weak_ptr<nn::ModuleExtension> weak = module.extension;
    if (!watch.empty())
      autograd::record_marker(fqn + " pre_backward", [weak] {
        if (auto st = weak.lock()) static_cast<FSDPState*>(st.get())->pre_backward();
      }, watch);
  }
  if (state_ctx->iter_forward_root == this) {
    comm_ctx->forward_order = comm_ctx->current_forward_order;
    state_ctx->iter_forward_root = nullptr;
    comm_ctx->release_all_gather_state();
  }
  if (mp_policy.output_dtype) cast_floating(outputs, *mp_policy.output_dtype);
  training_state = TrainingState::Idle;
}

void FSDPState::pre_backward() {
  training_state = TrainingState::PreBackward;
  if (state_ctx->post_backward_final_callback_pass != autograd::backward_pass_id()) {
    state_ctx->post_backward_final_callback_pass = autograd::backward_pass_id();
    std::weak_ptr<nn::ModuleExtension> weak = state_ctx->root->module.extension;
    autograd::queue_callback([weak] {
      if (auto st = weak.lock()) static_cast<FSDPState*>(st.get())->root_post_backward_final_callback();
    });
  }
  if (param_group) param_group->pre_backward(/*default_prefetch=*/backward_prefetch.empty());
  for (FSDPState* target : backward_prefetch) {  // in the order given, as PyTorch (the first runs first)
    FSDPParamGroup* g = target->param_group.get();
    if (!g) continue;
    TrainingStateGuard prefetching(*g, TrainingState::PreBackward);
    g->unshard(/*async_op=*/true);
  }
}

void FSDPState::root_post_backward_final_callback() {
  for (FSDPState* st : state_ctx->all_states) {
    FSDPParamGroup* g = st->param_group.get();
    if (g && g->training_state != TrainingState::PostBackward) g->post_backward();
    st->training_state = TrainingState::Idle;
    if (!g) continue;
    g->training_state = TrainingState::Idle;
    if (state_ctx->is_last_backward) g->finalize_backward();
  }
  if (state_ctx->is_last_backward) comm_ctx->post_forward_order.clear();
  state_ctx->post_backward_final_callback_pass = 0;
}

void FSDPState::reshard_for_io() {
  if (!param_group) return;
  param_group->wait_for_unshard();
  if (param_group->sharded_state != ShardedState::Sharded) {
    TrainingStateGuard idle(*param_group, TrainingState::Idle);
    param_group->reshard();
  }
}

void FSDPState::before_move(nn::Module&) { reshard_for_io(); }

void FSDPState::after_move(nn::Module&) {
  if (!param_group) return;
  for (auto& p : param_group->fsdp_params) {
    p->reset_sharded_param();
    if (param_group->lazily_initialized()) p->init_dtype_attrs(param_group->mp_policy);
  }
}

void FSDPState::before_state_dict(nn::Module&) { reshard_for_io(); }

void FSDPState::after_load_state_dict(nn::Module& m) { after_move(m); }

}  // namespace tessera::fsdp
