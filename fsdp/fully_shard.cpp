#include "fsdp/fully_shard.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <unordered_map>

#include "autograd/tape.h"
#include "dtensor/dtensor.h"

namespace tessera::fsdp {

namespace {

MeshPtr default_mesh() {
  static MeshPtr mesh;
  if (!mesh) mesh = init_device_mesh("cpu", {dist::world_size()}, {"dp"});
  return mesh;
}

MeshInfo mesh_info_for(const MeshPtr& mesh) {
  TS_CHECK(mesh->ndim() == 1 || mesh->ndim() == 2,
           "fully_shard expects a 1D or 2D DeviceMesh but got {} ({}D); flatten extra dims first", mesh->str(),
           mesh->ndim());
  MeshInfo m;
  m.mesh = mesh;
  int64_t shard_dim = mesh->ndim() - 1;  // 2-D: dim 0 replicates, dim 1 shards (HSDP)
  m.shard_group = mesh->get_group(shard_dim);
  m.shard_size = m.shard_group->size();
  m.shard_rank = m.shard_group->rank();
  if (mesh->ndim() == 2) {
    m.replicate_group = mesh->get_group(0);
    m.replicate_size = m.replicate_group->size();
    m.replicate_rank = m.replicate_group->rank();
  }
  return m;
}

struct Managed {
  Tensor param;
  std::string fqn;
  std::vector<ParamSlot> slots;
};

// Parameters of `root` not owned by an already sharded submodule, each with
// every (module, name) slot that holds it.
std::vector<Managed> managed_params(nn::Module& root, const std::vector<Tensor>& ignored) {
  std::vector<Managed> out;
  std::unordered_map<TensorImpl*, size_t> index;
  std::function<void(nn::Module&, const std::string&)> walk = [&](nn::Module& m, const std::string& prefix) {
    if (&m != &root && state_of(m) != nullptr) return;  // already its own group
    for (auto& slot : m.parameter_slots()) {
      const Tensor& p = slot.value;
      if (!p.defined()) continue;
      bool skip = std::any_of(ignored.begin(), ignored.end(), [&](const Tensor& t) { return t.is_same(p); });
      if (skip) continue;
      std::string fqn = prefix.empty() ? slot.name : prefix + "." + slot.name;
      auto it = index.find(p.impl());
      if (it == index.end()) {
        index[p.impl()] = out.size();
        out.push_back({p, fqn, {{&m, slot.name}}});
      } else {
        out[it->second].slots.push_back({&m, slot.name});  // tied: every holder swaps together
      }
    }
    for (auto& [name, child] : m.named_children()) walk(*child, prefix.empty() ? name : prefix + "." + name);
  };
  walk(root, "");
  return out;
}

std::vector<FSDPState*> states_under(nn::Module& module, bool recurse) {
  std::vector<FSDPState*> out;
  if (!recurse) {
    out.push_back(&fsdp_state(module));
    return out;
  }
  for (auto& [name, m] : module.named_modules())
    if (FSDPState* st = state_of(*m)) out.push_back(st);
  return out;
}

}  // namespace

FSDPState& fsdp_state(nn::Module& module) {
  FSDPState* st = state_of(module);
  TS_CHECK(st != nullptr, "{} is not an FSDP module: apply fully_shard to it first", module.type_name());
  return *st;
}

bool is_fully_sharded(nn::Module& module) { return state_of(module) != nullptr; }

nn::Module& fully_shard(nn::Module& module, const FullyShardOptions& options) {
  dist::init();
  TS_CHECK(state_of(module) == nullptr, "fully_shard: {} already has FSDP state (fully_shard applied twice?)",
           module.type_name());
  TS_CHECK(module.extension == nullptr, "fully_shard: {} already carries another extension", module.type_name());
  MeshPtr mesh = options.mesh ? options.mesh : default_mesh();
  // meta: a planned run (tools/plan.h), over simulated process groups only.
  // cuda: init_device_mesh has checked that this build and machine have it.
  TS_CHECK(mesh->device_type() == "cpu" || mesh->device_type() == "async_cpu" || mesh->device_type() == "cuda" ||
               (mesh->device_type() == "meta" && mesh->get_group(0)->simulated()),
           "fully_shard: mesh device type '{}' is not one FSDP runs on (cpu, async_cpu, cuda; meta over "
           "simulated process groups)",
           mesh->device_type());
  MeshInfo info = mesh_info_for(mesh);

  std::vector<std::unique_ptr<FSDPParam>> params;
  for (auto& m : managed_params(module, options.ignored_params)) {
    if (!is_dtensor(m.param) && m.param.storage() && !m.param.storage()->is_allocated() &&
        !m.param.storage()->release_note.empty()) {
      TS_CHECK(false,
               "fully_shard: parameter {} is already managed by another FSDP group ({}). For shared/tied "
               "parameters, apply fully_shard to a module that holds every module using them",
               m.fqn, m.param.storage()->release_note);
    }
    std::optional<Shard> placement = options.shard_placement_fn ? options.shard_placement_fn(m.param) : std::nullopt;
    params.push_back(std::make_unique<FSDPParam>(m.param, m.slots, info, placement.value_or(Shard{0}), m.fqn,
                                                 options.offload_policy && options.offload_policy->offloads_to_cpu()));
  }

  std::unique_ptr<FSDPParamGroup> group;
  bool raf_set = !std::holds_alternative<std::monostate>(options.reshard_after_forward);
  if (!params.empty()) {
    group = std::make_unique<FSDPParamGroup>(std::move(params), info, "", options.mp_policy);
    if (const bool* b = std::get_if<bool>(&options.reshard_after_forward)) group->reshard_after_forward = *b;
    if (const int* k = std::get_if<int>(&options.reshard_after_forward)) {
      int w = info.shard_size;
      TS_CHECK(*k >= 1 && w % *k == 0,
               "fully_shard: reshard_after_forward={} must be a positive divisor of the shard size {}", *k, w);
      if (*k == 1) {
        std::fprintf(stderr, "tessera: reshard_after_forward=1 keeps the whole parameter; using false\n");
        group->reshard_after_forward = false;
      } else if (*k < w) {
        // ZeRO++ hpZ: after forward keep a 1/k slice; backward gathers over k consecutive ranks.
        MeshInfo post;
        post.mesh = mesh;
        const std::string name = fmt::format("{}/post-forward{}", info.shard_group->name(), *k);
        if (info.shard_group->simulated()) {  // a planned rank names its k ranks (it cannot split)
          std::vector<int> block(static_cast<size_t>(*k));
          std::iota(block.begin(), block.end(), info.shard_rank / *k * *k);
          post.shard_group = info.shard_group->new_group(block, name);
        } else {
          post.shard_group = info.shard_group->split(info.shard_rank / *k, info.shard_rank % *k, name);
        }
        post.shard_size = post.shard_group->size();
        post.shard_rank = post.shard_group->rank();
        group->post_forward_mesh_info = post;
      }
    }
  }
  auto state = std::make_shared<FSDPState>(module, std::move(group), options.mp_policy, raf_set);
  module.extension = state;
  FSDPState* st = state.get();
  module.register_forward_pre_hook([st](nn::Module&, TensorList& args) { st->pre_forward(args); }, /*prepend=*/true);
  module.register_forward_hook([st](nn::Module&, const TensorList&, TensorList& out) { st->post_forward(out); });
  return module;
}

void UnshardHandle::wait() {
  if (group_) group_->wait_for_unshard();
  group_ = nullptr;
}

UnshardHandle unshard(nn::Module& module, bool async_op) {
  FSDPState& st = fsdp_state(module);
  if (!st.param_group) return {};
  if (!st.comm_ctx) {  // before the first forward: a context of its own
    st.comm_ctx = std::make_shared<FSDPCommContext>();
    st.param_group->comm_ctx = st.comm_ctx.get();
  }
  st.param_group->unshard(/*async_op=*/true);
  UnshardHandle handle(st.param_group.get());
  if (!async_op) handle.wait();
  return async_op ? handle : UnshardHandle();
}

void reshard(nn::Module& module) {
  FSDPState& st = fsdp_state(module);
  if (!st.param_group) return;
  st.param_group->wait_for_unshard();
  TrainingStateGuard idle(*st.param_group, TrainingState::Idle);
  if (st.param_group->comm_ctx == nullptr) {
    st.comm_ctx = std::make_shared<FSDPCommContext>();
    st.param_group->comm_ctx = st.comm_ctx.get();
  }
  st.param_group->reshard();
}

void set_requires_gradient_sync(nn::Module& module, bool sync, bool recurse) {
  for (FSDPState* st : states_under(module, recurse))
    if (st->param_group) st->param_group->requires_gradient_sync = sync;
}

void set_requires_all_reduce(nn::Module& module, bool all_reduce, bool recurse) {
  for (FSDPState* st : states_under(module, recurse))
    if (st->param_group) st->param_group->requires_all_reduce = all_reduce;
}

void set_reshard_after_forward(nn::Module& module, bool reshard_after, bool recurse) {
  for (FSDPState* st : states_under(module, recurse)) {
    st->raf_set_by_user = true;
    if (!st->param_group) continue;
    st->param_group->reshard_after_forward = reshard_after;
    st->param_group->post_forward_mesh_info.reset();
  }
}

void set_reshard_after_backward(nn::Module& module, bool reshard_after, bool recurse) {
  for (FSDPState* st : states_under(module, recurse))
    if (st->param_group) st->param_group->reshard_after_backward = reshard_after;
}

void set_is_last_backward(nn::Module& module, bool last) {
  FSDPState& st = fsdp_state(module);
  st.lazy_init();
  st.state_ctx->is_last_backward = last;
}

void reduce_gradients(nn::Module& root) {
  FSDPState& st = fsdp_state(root);
  st.lazy_init();
  const auto& states = st.state_ctx->all_states;  // pre-order from the root
  // Group by group in the order a backward reaches them (the reverse of the
  // forward's pre-order), each as a synchronizing backward's post-backward.
  for (auto it = states.rbegin(); it != states.rend(); ++it) {
    FSDPParamGroup* g = (*it)->param_group.get();
    if (!g) continue;
    const bool sync = g->requires_gradient_sync, reshard = g->reshard_after_backward;
    g->requires_gradient_sync = true;
    g->reshard_after_backward = false;  // the parameters stay until a reshard
    g->post_backward();
    g->requires_gradient_sync = sync;
    g->reshard_after_backward = reshard;
  }
  for (FSDPState* s : states) {
    s->training_state = TrainingState::Idle;
    if (!s->param_group) continue;
    s->param_group->training_state = TrainingState::Idle;
    s->param_group->finalize_backward();
  }
  st.comm_ctx->post_forward_order.clear();
}

void set_gradient_divide_factor(nn::Module& module, double factor) {
  TS_CHECK(factor > 0, "set_gradient_divide_factor: the factor must be positive, got {}", factor);
  for (FSDPState* st : states_under(module, true))
    if (st->param_group) st->param_group->gradient_divide_factor = factor;
}

void set_unshard_in_backward(nn::Module& module, bool unshard_in_backward) {
  FSDPState& st = fsdp_state(module);
  if (st.param_group) st.param_group->unshard_in_backward = unshard_in_backward;
}

void set_modules_to_forward_prefetch(nn::Module& module, const std::vector<nn::Module*>& targets) {
  FSDPState& st = fsdp_state(module);
  st.forward_prefetch.clear();
  for (nn::Module* t : targets) st.forward_prefetch.push_back(&fsdp_state(*t));
  st.explicit_forward_prefetch = true;
}

void set_modules_to_backward_prefetch(nn::Module& module, const std::vector<nn::Module*>& targets) {
  FSDPState& st = fsdp_state(module);
  st.backward_prefetch.clear();
  for (nn::Module* t : targets) st.backward_prefetch.push_back(&fsdp_state(*t));
}

void reset_iter_state(nn::Module& root) {
  FSDPState& st = fsdp_state(root);
  TS_CHECK(!st.is_root.has_value() || *st.is_root, "reset_iter_state: call it on the root FSDP module");
  autograd::clear_tape();
  if (!st.state_ctx) return;  // never ran: nothing in flight
  for (auto& r : st.comm_ctx->reductions) {
    try {
      advance_reduce(r, st.comm_ctx->streams);
      if (r.all_reduce) r.all_reduce->wait();
    } catch (const std::exception&) {
    }
  }
  st.comm_ctx->reductions.clear();
  // Nothing queued on the streams may still use the buffers dropped here.
  if (st.comm_ctx->streams.initialized()) {
    try {
      synchronize(st.comm_ctx->streams.all_gather->device());
    } catch (const std::exception&) {
    }
  }
  st.comm_ctx->all_gather_state.reset();
  st.comm_ctx->reduce_scatter_state.reset();
  st.comm_ctx->post_reduce_event = nullptr;
  st.comm_ctx->post_forward_order.clear();
  st.comm_ctx->current_forward_order.clear();
  for (FSDPState* s : st.state_ctx->all_states) {
    s->training_state = TrainingState::Idle;
    if (s->param_group) s->param_group->reset_iter_state();
  }
  st.state_ctx->iter_forward_root = nullptr;
  st.state_ctx->post_backward_final_callback_pass = 0;
}

void set_prefetch(nn::Module& root, bool enabled) {
  FSDPState& st = fsdp_state(root);
  TS_CHECK(st.is_root.value_or(true), "set_prefetch: '{}' is not the root of its FSDP modules", st.fqn);
  st.prefetch_enabled = enabled;  // before the first forward (even on meta): applied at lazy init
  if (st.comm_ctx) st.comm_ctx->prefetch = enabled;
}

TensorList call_with_fsdp_hooks(nn::Module& module, TensorList inputs,
                                const std::function<TensorList(const TensorList&)>& method) {
  return module.call_with_hooks(std::move(inputs), method);
}

std::function<TensorList(TensorList)> register_fsdp_forward_method(
    nn::Module& module, std::function<TensorList(const TensorList&)> method) {
  return [&module, method = std::move(method)](TensorList inputs) {
    return call_with_fsdp_hooks(module, std::move(inputs), method);
  };
}

}  // namespace tessera::fsdp
