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

Tensor dispatch_relayout(const Tensor& g, const Tensor& like) {
  DistCall call;
  call.name = "gradient layout";
  call.cls = OpClass::Relayout;
  call.inputs = {g, like};
  return dispatch_distributed(call)[0];
}

}  // namespace tessera
