#include "fsdp/fsdp_param_group.h"

#include "autograd/tape.h"
#include "dtensor/dtensor.h"
#include "runtime/allocator.h"
#include "runtime/trace.h"

namespace tessera::fsdp {

const char* training_state_name(TrainingState s) {
  switch (s) {
    case TrainingState::Idle: return "IDLE";
    case TrainingState::Forward: return "FORWARD";
    case TrainingState::PreBackward: return "PRE_BACKWARD";
    case TrainingState::PostBackward: return "POST_BACKWARD";
  }
  return "?";
}

void FSDPCommContext::event(const char* what, const FSDPParamGroup& g) {
  if (on_event) on_event(what, g.fqn, g.training_state);
}

TrainingStateGuard::TrainingStateGuard(FSDPParamGroup& group, TrainingState state)
    : group_(group), saved_(group.training_state) {
  group.training_state = state;
}

TrainingStateGuard::~TrainingStateGuard() { group_.training_state = saved_; }

FSDPParamGroup::FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, MeshInfo info, std::string name,
                               MixedPrecisionPolicy mp)
    : fqn(std::move(name)), fsdp_params(std::move(params)), mesh_info(std::move(info)), mp_policy(mp) {}

std::vector<FSDPParam*> FSDPParamGroup::params() const {
  std::vector<FSDPParam*> out;
  for (const auto& p : fsdp_params) out.push_back(p.get());
  return out;
}

std::vector<FSDPParam*> FSDPParamGroup::params_to_gather() const { return params(); }

DType FSDPParamGroup::param_dtype() const { return fsdp_params.front()->param_dtype; }
DType FSDPParamGroup::reduce_dtype() const {
  for (const auto& p : fsdp_params)
    if (p->requires_grad) return p->reduce_dtype;
  return fsdp_params.front()->reduce_dtype;
}

const MeshInfo& FSDPParamGroup::gather_mesh() const {
  return sharded_state == ShardedState::ShardedPostForward ? *post_forward_mesh_info : mesh_info;
}

void FSDPParamGroup::lazy_init() {
  if (initialized_) return;
  const FSDPParam* first_trainable = nullptr;
  for (auto& p : fsdp_params) {
    // On meta only to plan a step (runtime/allocator.h's MetaAccounting, tools/plan.h).
    TS_CHECK(!p->sharded_param.is_meta() || meta_accounting_active(),
             "FSDP parameters should be materialized from meta device before training, but {} is still on meta: "
             "call module.to_empty(device) and init_weights(seed) first",
             p->fqn);
    p->reset_sharded_param();
    p->init_dtype_attrs(mp_policy);
    if (!p->requires_grad) continue;
    if (first_trainable == nullptr) first_trainable = p.get();
    TS_CHECK(p->orig_dtype == first_trainable->orig_dtype,
             "FSDP expects uniform original parameter dtype but got {} ({}) and {} ({})",
             dtype_name(first_trainable->orig_dtype), first_trainable->fqn, dtype_name(p->orig_dtype), p->fqn);
  }
  initialized_ = true;
}

void FSDPParamGroup::to_sharded() {
  for (auto& p : fsdp_params) p->to_sharded();
  sharded_state = ShardedState::Sharded;
}

void FSDPParamGroup::to_unsharded() {
  for (auto& p : fsdp_params) p->to_unsharded();
  sharded_state = ShardedState::Unsharded;
}

void FSDPParamGroup::unshard(bool async_op) {
  if (sharded_state == ShardedState::Unsharded || all_gather_) return;
  if (training_state == TrainingState::PreBackward && !unshard_in_backward) return;
  lazy_init();
  comm_ctx->event("unshard", *this);
  trace::Scope span(trace_lane(), "unshard");
  FSDPStreams& streams = comm_ctx->streams;
  streams.init(fsdp_params.front()->compute_device);
  // Outside forward (a user's unshard, or backward reading post-forward
  // shards made on the compute stream) the copy-in waits for compute; in
  // forward the root pre-forward made it wait once for the optimizer step.
  if (training_state != TrainingState::Forward) {
    streams.all_gather_copy_in->wait_stream(current_stream(fsdp_params.front()->compute_device));
  }
  all_gather_ = foreach_all_gather(params_to_gather(), gather_mesh().shard_group, param_dtype(), streams,
                                   comm_ctx->all_gather_state);
  if (!async_op) wait_for_unshard();
}

void FSDPParamGroup::wait_for_unshard() {
  if (!all_gather_) return;
  BufferState copied = foreach_all_gather_copy_out(*all_gather_, params_to_gather());
  all_gather_.reset();
  if (!copied.in_use()) {
    // The copy-out has run (always, on the CPU's synchronous streams): the buffer goes now.
  } else if (training_state == TrainingState::Forward) {
    // Kept until the next all-gather's copy-in waits for this copy-out, so that
    // all-gather overlaps it (PyTorch: all_gather_state); the root's post-forward drops the last.
    comm_ctx->release_all_gather_state();
    comm_ctx->all_gather_state = std::move(copied);
  } else {
    comm_ctx->streams.all_gather_copy_in->wait_event(*copied.event);
  }
  to_unsharded();
}

void FSDPCommContext::release_all_gather_state() {
  if (!all_gather_state) return;
  streams.all_gather_copy_in->wait_event(*all_gather_state->event);
  all_gather_state.reset();
}

void FSDPParamGroup::reshard() {
  if (training_state == TrainingState::Forward) {
    if (!reshard_after_forward) return;  // kept for backward (ZeRO-2 style)
    if (post_forward_mesh_info && sharded_state == ShardedState::Unsharded) {
      comm_ctx->event("reshard", *this);
      int k = post_forward_mesh_info->shard_size, index = post_forward_mesh_info->shard_rank;
      for (auto& p : fsdp_params) p->to_sharded_post_forward(k, index);
      sharded_state = ShardedState::ShardedPostForward;
      return;
    }
  }
  if (sharded_state == ShardedState::Sharded) return;
  comm_ctx->event("reshard", *this);
  trace::Scope span(trace_lane(), "reshard");
  to_sharded();
}

void FSDPParamGroup::pre_forward() {
  training_state = TrainingState::Forward;
  unshard(/*async_op=*/true);
  wait_for_unshard();
}

void FSDPParamGroup::post_forward() {
  reshard();
  post_forward_indices.push_back(comm_ctx->post_forward_order.size());
  comm_ctx->post_forward_order.push_back(this);
  training_state = TrainingState::Idle;
}

void FSDPParamGroup::pre_backward(bool default_prefetch) {
  if (training_state == TrainingState::PreBackward) return;
  training_state = TrainingState::PreBackward;
  unshard(/*async_op=*/true);
  wait_for_unshard();
  if (!default_prefetch || !comm_ctx->prefetch || post_forward_indices.empty()) return;
  // Reverse post-forward order: the group whose forward finished just before ours.
  size_t i = post_forward_indices.back();
  post_forward_indices.pop_back();
  if (i == 0) return;
  FSDPParamGroup* target = comm_ctx->post_forward_order[i - 1];
  TrainingStateGuard prefetching(*target, TrainingState::PreBackward);
  target->unshard(/*async_op=*/true);
}

void FSDPParamGroup::drain_reductions(size_t keep_in_flight) {
  auto& queue = comm_ctx->reductions;
  while (queue.size() > keep_in_flight) {
    if (auto e = finish_reduce(queue.front(), comm_ctx->streams)) comm_ctx->post_reduce_event = e;
    queue.pop_front();
  }
  for (auto& r : queue) advance_reduce(r, comm_ctx->streams);  // the reduce-scatter done, HSDP all-reduce issued
}

void FSDPParamGroup::post_backward() {
  training_state = TrainingState::PostBackward;
  comm_ctx->event("post_backward", *this);
  autograd::NoGradGuard no_grad;
  // Fold a fresh gradient into the reduce-dtype accumulator of earlier no-sync micro-batches.
  for (auto& p : fsdp_params) {
    if (!p->unsharded_param.defined()) continue;
    Tensor g = p->local_grad(p->unsharded_param.grad());
    if (!g.defined()) continue;
    if (p->unsharded_accumulated_grad.defined()) {
      ops::add_(p->unsharded_accumulated_grad, ops::to(g, p->unsharded_accumulated_grad.dtype()));
      p->unsharded_param.set_grad(Tensor());
    } else if (!requires_gradient_sync && p->reduce_dtype != g.dtype()) {
      p->unsharded_accumulated_grad = ops::to(g, p->reduce_dtype);
      p->unsharded_param.set_grad(Tensor());
    }
  }
  if (!requires_gradient_sync) {  // no-sync micro-batch: gradients stay unsharded
    if (reshard_after_backward) reshard();
    return;
  }
  std::vector<FSDPParam*> with_grad;
  std::vector<Tensor> grads;
  for (auto& p : fsdp_params) {
    if (p->unsharded_accumulated_grad.defined()) {
      with_grad.push_back(p.get());
      grads.push_back(p->unsharded_accumulated_grad);
      p->unsharded_accumulated_grad = Tensor();
    } else if (p->unsharded_param.defined() && p->unsharded_param.grad().defined()) {
      with_grad.push_back(p.get());
      grads.push_back(p->local_grad(p->unsharded_param.grad()));
      p->unsharded_param.set_grad(Tensor());
    }
  }
  if (reshard_after_backward) reshard();
  if (with_grad.empty()) return;
  // At most one reduce-scatter in flight: the previous group's completes first
  // (its HSDP all-reduce may go on).
  drain_reductions(1);
  comm_ctx->streams.init(fsdp_params.front()->compute_device);
  comm_ctx->reductions.push_back(foreach_reduce(with_grad, grads, mesh_info, reduce_dtype(),
                                                divide_ops(mesh_info, gradient_divide_factor),
                                                requires_all_reduce, &partial_reduce_output_, comm_ctx->streams,
                                                comm_ctx->reduce_scatter_state));
}

void FSDPParamGroup::finalize_backward() {
  drain_reductions(0);
  // The optimizer (on the compute stream) reads the gradients the reduce-scatter stream wrote.
  Stream& compute = current_stream(fsdp_params.front()->compute_device);
  if (comm_ctx->post_reduce_event) {
    compute.wait_event(*comm_ctx->post_reduce_event);
    comm_ctx->post_reduce_event = nullptr;
  }
  if (comm_ctx->reduce_scatter_state) {
    compute.wait_event(*comm_ctx->reduce_scatter_state->event);
    comm_ctx->reduce_scatter_state.reset();
  }
  if (all_gather_) {  // a prefetch for a group this backward never reached
    if (all_gather_->work) all_gather_->work->wait();
    comm_ctx->streams.all_gather_copy_in->wait_event(*all_gather_->event);
    all_gather_.reset();
  }
  post_forward_indices.clear();
}

void FSDPParamGroup::reset_iter_state() {
  if (all_gather_) {
    try {
      if (all_gather_->work) all_gather_->work->wait();
      synchronize(all_gather_->output.device());  // nothing queued may still use the buffer
    } catch (const std::exception&) {
    }
    all_gather_.reset();
  }
  for (auto& p : fsdp_params) {
    p->unsharded_accumulated_grad = Tensor();
    if (p->unsharded_param.defined()) p->unsharded_param.set_grad(Tensor());
  }
  if (sharded_state != ShardedState::Sharded) to_sharded();
  training_state = TrainingState::Idle;
  post_forward_indices.clear();
  partial_reduce_output_ = Tensor();
}

}  // namespace tessera::fsdp
