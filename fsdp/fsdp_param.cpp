#include "fsdp/fsdp_param.h"

#include <algorithm>

#include "dtensor/redistribute.h"

namespace tessera::fsdp {

namespace {
// The parameter FSDP shards: a plain parameter, or a tensor-parallel DTensor's local tensor.
Tensor local_of(const Tensor& param) { return is_dtensor(param) ? dtensor_spec(param).local : param; }
}  // namespace

FSDPParam::FSDPParam(const Tensor& param_in, std::vector<ParamSlot> slots, const MeshInfo& mesh_info, Shard placement,
                     std::string fqn_in, bool offload)
    : fqn(std::move(fqn_in)), offload_to_cpu(offload), slots_(std::move(slots)), mesh_info_(mesh_info) {
  const Tensor param = local_of(param_in);
  MeshPtr sharded_mesh = mesh_info.mesh;
  Placements outer;  // the tensor-parallel placement, outside FSDP's
  Shape global = param.shape();
  if (is_dtensor(param_in)) {
    const DTensorSpec& spec = dtensor_spec(param_in);
    TS_CHECK(spec.mesh->ndim() == 1 && !is_partial(spec.placements[0]),
             "fully_shard: parameter {} is a DTensor {}; FSDP composes with tensor parallelism (Shard or Replicate "
             "over a 1-D mesh from parallelize_module)",
             fqn, spec.str());
    const std::string& tp_dim = spec.mesh->dim_names()[0];
    const auto& fsdp_dims = mesh_info.mesh->dim_names();
    TS_CHECK(*spec.mesh->root() == *mesh_info.mesh->root() &&
                 std::find(fsdp_dims.begin(), fsdp_dims.end(), tp_dim) == fsdp_dims.end(),
             "fully_shard: parameter {} is tensor-parallel over {}, which is not another dim of the mesh FSDP "
             "shards over ({}); slice both from one init_device_mesh (mesh[\"tp\"], mesh[\"dp\"])",
             fqn, spec.mesh->str(), mesh_info.mesh->str());
    tp_mesh = spec.mesh;
    tp_placements = spec.placements;
    tp_shape = spec.global_shape;
    std::vector<std::string> names{tp_dim};
    names.insert(names.end(), fsdp_dims.begin(), fsdp_dims.end());
    sharded_mesh = mesh_info.mesh->root()->slice(names, /*any_order=*/true);
    outer = spec.placements;
    global = spec.global_shape;
  }
  TS_CHECK(param.dim() > 0, "fully_shard doesn't support scalar parameters. Change {} to a 1D tensor with numel "
           "equal to 1.",
           fqn);
  TS_CHECK(param.is_contiguous(), "fully_shard: parameter {} must be contiguous (strides {})", fqn,
           shape_str(param.strides()));
  orig_size = param.shape();
  orig_dtype = param.dtype();
  param_dtype = reduce_dtype = orig_dtype;
  requires_grad = param_in.requires_grad();
  shard_dim = wrap_dim(placement.dim, param.dim(), "fully_shard (shard_placement_fn)");
  const int64_t w = mesh_info.shard_size, n = orig_size[static_cast<size_t>(shard_dim)];
  TS_CHECK(shard_dim == 0 || n % w == 0,
           "FSDP does not support uneven sharding on dim {}: parameter {} has size {} there, not a multiple of "
           "the shard size {}",
           shard_dim, fqn, n, w);
  auto [len, start] = shard_size_and_offset(n, w, mesh_info.shard_rank);
  sharded_size = orig_size;
  sharded_size[static_cast<size_t>(shard_dim)] = len;
  padded_sharded_size = orig_size;
  padded_sharded_size[static_cast<size_t>(shard_dim)] = (n + w - 1) / w;
  padded_numel = shape_numel(padded_sharded_size);

  compute_device = param.device();
  const Device device = offloaded() ? Device::cpu() : compute_device;
  sharded_data = zeros({padded_numel}, orig_dtype, device);
  Tensor padded = ops::view(sharded_data, padded_sharded_size);
  Tensor local = ops::narrow(padded, shard_dim, 0, len);
  if (!device.is_meta()) {
    Tensor dst = local;
    ops::copy_(dst, ops::narrow(param, shard_dim, start, len));  // device to host when offloaded
    if (offloaded()) synchronize(compute_device);                // the host owns the shard from here
  }
  Placements placements = outer;
  if (mesh_info.hsdp()) placements.push_back(Replicate{});
  placements.push_back(Shard{shard_dim});
  sharded_param = make_dtensor(local, sharded_mesh, placements, global);
  sharded_param.set_requires_grad(requires_grad);
  // The full parameter is no longer needed: release its bytes, and leave a note
  // for whoever still holds it (an optimizer built before fully_shard).
  if (!compute_device.is_meta() && param.storage()) {
    param.storage()->release();
    param.storage()->release_note =
        fmt::format("parameter {} was sharded by fully_shard; use the module's parameters() after fully_shard "
                    "(build the optimizer after it)",
                    fqn);
  }
  register_all(sharded_param);
}

void FSDPParam::init_dtype_attrs(const MixedPrecisionPolicy& mp) {
  param_dtype = mp.param_dtype && is_floating(orig_dtype) ? *mp.param_dtype : orig_dtype;
  reduce_dtype = mp.reduce_dtype ? *mp.reduce_dtype : param_dtype;
}

Tensor FSDPParam::all_gather_input() const {
  if (state == ShardedState::ShardedPostForward) return post_forward_data;
  // Offloaded: to the device first (queued on the calling stream, the copy-in
  // stream), then cast there.
  Tensor data = offloaded() ? ops::to(sharded_data, compute_device) : sharded_data;
  return param_dtype == data.dtype() ? data : ops::to(data, param_dtype);
}

void FSDPParam::alloc_unsharded() {
  if (!unsharded_buffer.defined() || unsharded_buffer.dtype() != param_dtype ||
      unsharded_buffer.device() != compute_device) {
    const int64_t w = mesh_info_.shard_size;
    unsharded_buffer = empty({w * padded_numel}, param_dtype, compute_device);
    // Shard(0): the real rows come first and all padding last, so the full
    // parameter is simply the buffer's first numel elements.
    unsharded_local = shard_dim == 0
                          ? ops::view(ops::narrow(unsharded_buffer, 0, 0, shape_numel(orig_size)), orig_size)
                          : empty(orig_size, param_dtype, compute_device);
    unsharded_param = tp_mesh ? make_dtensor(unsharded_local, tp_mesh, tp_placements, tp_shape) : unsharded_local;
    if (requires_grad) unsharded_param.set_requires_grad(true);
    return;
  }
  unsharded_buffer.storage()->allocate();
  unsharded_local.storage()->allocate();
}

void FSDPParam::free_unsharded() {
  if (!unsharded_buffer.defined()) return;
  unsharded_buffer.storage()->release();
  unsharded_local.storage()->release();
}

Tensor FSDPParam::local_grad(const Tensor& grad) const {
  if (!grad.defined() || !is_dtensor(grad)) return grad;
  return local_at(grad, tp_placements);
}

void FSDPParam::register_all(const Tensor& value) {
  for (auto& s : slots_) {
    nn::Module::Slot* slot = s.module->find_parameter_slot(s.name);
    TS_ASSERT(slot != nullptr);
    slot->value = value;
  }
}

Tensor FSDPParam::current_registered() const {
  return slots_.front().module->find_parameter_slot(slots_.front().name)->value;
}

void FSDPParam::to_sharded() {
  register_all(sharded_param);
  free_unsharded();
  post_forward_data = Tensor();
  state = ShardedState::Sharded;
}

void FSDPParam::to_sharded_post_forward(int k, int index) {
  int64_t slice = unsharded_buffer.numel() / k;
  post_forward_data = ops::clone(ops::narrow(unsharded_buffer, 0, index * slice, slice));
  register_all(sharded_param);
  free_unsharded();
  state = ShardedState::ShardedPostForward;
}

void FSDPParam::to_unsharded() {
  // Freezing (or unfreezing) the sharded parameter carries over to compute.
  requires_grad = sharded_param.requires_grad();
  if (unsharded_param.requires_grad() != requires_grad) unsharded_param.set_requires_grad(requires_grad);
  register_all(unsharded_param);
  post_forward_data = Tensor();
  state = ShardedState::Unsharded;
}

void FSDPParam::reset_sharded_param() {
  Tensor current = current_registered();
  if (!is_dtensor(current) || current.is_same(sharded_param)) return;
  const DTensorSpec& spec = dtensor_spec(current);
  Tensor local = spec.local;
  // A new padded buffer in the registered tensor's dtype and device (the host
  // when offloaded: to_empty(device) names the compute device), holding its values.
  const Device here = local.device();
  // A host tensor loaded into an offloaded parameter keeps the device it computes on.
  if (!(offloaded() && here.is_host_visible())) compute_device = here;
  sharded_data = zeros({padded_numel}, local.dtype(), offloaded() ? Device::cpu() : compute_device);
  Tensor padded = ops::view(sharded_data, padded_sharded_size);
  Tensor view = ops::narrow(padded, shard_dim, 0, sharded_size[static_cast<size_t>(shard_dim)]);
  if (!local.is_meta()) {
    Tensor dst = view;
    ops::copy_(dst, local);
    if (!local.device().is_host_visible() && dst.device().is_host_visible()) synchronize(local.device());
  }
  orig_dtype = local.dtype();
  sharded_param = make_dtensor(view, spec.mesh, spec.placements, spec.global_shape);
  sharded_param.set_requires_grad(requires_grad);
  unsharded_buffer = Tensor();  // re-created in the (possibly new) dtype and device on next unshard
  unsharded_param = Tensor();
  unsharded_local = Tensor();
  register_all(sharded_param);
}

}  // namespace tessera::fsdp
