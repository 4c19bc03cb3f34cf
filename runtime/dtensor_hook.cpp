#include "runtime/dtensor_hook.h"

namespace tessera {

namespace {
DistHandler& handler() {
  static DistHandler h;
  return h;
}
}  // namespace

void set_dist_handler(DistHandler h) { handler() = std::move(h); }

bool any_distributed(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    if (t != nullptr && t->is_distributed()) return true;
  return false;
}

std::vector<Tensor> dispatch_distributed(DistCall& call) {
  TS_CHECK(static_cast<bool>(handler()),
           "{}: got a DTensor but no DTensor support is registered (link the dtensor layer)", call.name);
  return handler()(call);
}

Tensor dispatch_like(const char* name, const Tensor& x, std::function<Tensor(const Tensor&)> fn) {
  DistCall call;
  call.name = name;
  call.cls = OpClass::Like;
  call.inputs = {x};
  call.local = [fn = std::move(fn)](const TensorList& l) { return TensorList{fn(l[0])}; };
  return dispatch_distributed(call)[0];
}

std::vector<Tensor> dispatch_per_shard(const char* name, std::vector<Tensor> inputs, std::vector<int64_t> free_dims,
                                       std::vector<int> out_like,
                                       std::function<std::vector<Tensor>(const std::vector<Tensor>&)> local) {
  DistCall call;
  call.name = name;
  call.cls = OpClass::PerShard;
  call.inputs = std::move(inputs);
  call.free_dims = std::move(free_dims);
  call.out_like = std::move(out_like);
  call.local = std::move(local);
  return dispatch_distributed(call);
}

Tensor dispatch_view(const char* name, const Tensor& x, Shape shape, std::vector<int64_t> perm) {
  DistCall call;
  call.name = name;
  call.cls = OpClass::View;
  call.inputs = {x};
  call.shape = std::move(shape);
  call.perm = std::move(perm);
  return dispatch_distributed(call)[0];
}

void refuse_distributed(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    TS_CHECK(t == nullptr || !t->is_distributed(),
             "{}: no sharding rule for DTensors (got {}); use the local tensor (to_local()) or the whole one "
             "(full_tensor())",
             op, t->str());
}

Tensor dispatch_relayout(const Tensor& g, const Tensor& like) {
  DistCall call;
  call.name = "gradient layout";
  call.cls = OpClass::Relayout;
  call.inputs = {g, like};
  return dispatch_distributed(call)[0];
}

}  // namespace tessera
