// Random fills of DTensors: each local element draws the counter of its
// position in the whole tensor (runtime/random.h), so a sharded
// initialisation equals the whole tensor's, sliced, at any world size.
#include "dtensor/rules.h"

namespace tessera::detail {

namespace {

TensorList random(OpCall& call) {
  const DTensorSpec& ref = dtensor_spec(call.inputs[0]);
  for (const auto& p : ref.placements)
    TS_CHECK(!is_partial(p), "{}: cannot fill a Partial DTensor with random values", call.name);
  // Element i of each box of the shard is element offset + i of the full tensor.
  const Shape strides = call.attrs.random.index_strides.empty() ? contiguous_strides(ref.global_shape) : call.attrs.random.index_strides;
  for (LocalBox& box : local_boxes(call.inputs[0])) {
    RandomSpec s = call.attrs.random;
    for (size_t d = 0; d < box.offset.size(); ++d) s.base += box.offset[d] * strides[d];
    s.index_strides = strides;
    call.attrs.fill(box.local, s);
  }
  return {call.inputs[0]};
}

}  // namespace

void register_random_rules() {
  register_rule(OpId::uniform_, random);
  register_rule(OpId::normal_, random);
}

}  // namespace tessera::detail
