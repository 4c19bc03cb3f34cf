// State dicts of an FSDP model.
//
// Sharded (the default): model.state_dict() returns the sharded DTensors
// themselves (FSDP reshards first), so saving costs no communication and no
// copy; load_state_dict of DTensors with the same placements copies into the
// shards in place.
//
// Full: every DTensor gathered to a whole tensor, one parameter at a time, so
// peak memory stays near one full parameter on top of the shards; and the
// reverse, full tensors cut down to each rank's shard.
#pragma once

#include <functional>

#include "nn/module.h"

namespace tessera::fsdp {

// Calls fn(name, full) for each entry in order, gathering one tensor at a time
// (a collective for DTensors: every rank must call it). With rank0_only, ranks
// other than 0 get an undefined tensor.
void for_each_full_tensor(const nn::StateDict& state, bool rank0_only,
                          const std::function<void(const std::string&, const Tensor&)>& fn);
// The whole model's full state dict (held at once: use for_each_full_tensor to stream).
nn::StateDict full_state_dict(nn::Module& model, bool rank0_only = true);
// Copies full tensors into the model's shards (plain parameters get the whole
// tensor). With from_rank0 only rank 0's `full` is read and each tensor is
// broadcast in turn. strict: missing and unexpected keys are errors. dtypes are
// converted; shapes must match.
void load_full_state_dict(nn::Module& model, const nn::StateDict& state, bool from_rank0 = false,
                          bool strict = true);

}  // namespace tessera::fsdp
