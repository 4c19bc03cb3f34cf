#include "runtime/op_call.h"

namespace tessera {

namespace {
OpCallHandler handler = nullptr;
}  // namespace

void set_op_call_handler(OpCallHandler h) { handler = h; }

bool intercepts(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    if (t != nullptr && t->is_subclass()) return true;
  return false;
}

TensorList intercept(OpCall call) {
  TS_CHECK(handler != nullptr, "{}: got a tensor subclass but no handler for its ops is registered", call.name);
  return handler(call);
}

}  // namespace tessera
