// The sharding rules of ops that run on each shard alone (softmax, attention,
// RoPE: OpClass::PerShard) and of views (reshape, view, permute, transpose:
// OpClass::View). Internal to the dtensor layer: dtensor/ops.cpp dispatches
// to them.
#pragma once

#include <vector>

#include "runtime/dtensor_hook.h"

namespace tessera::detail {

std::vector<Tensor> per_shard_rule(DistCall& call);
std::vector<Tensor> view_rule(DistCall& call);

}  // namespace tessera::detail
