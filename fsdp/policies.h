// FSDP policies as plain structs (PyTorch: fsdp/_fully_shard/_fsdp_api.py).
#pragma once

#include <functional>
#include <optional>
#include <variant>
#include <vector>

#include "dtensor/device_mesh.h"
#include "dtensor/placement.h"

namespace tessera::fsdp {

// Module-level mixed precision. Clamping rules (PyTorch's init_dtype_attrs):
// reduce_dtype is dropped when equal to param_dtype; param_dtype is dropped
// when equal to the parameter's own dtype.
struct MixedPrecisionPolicy {
  std::optional<DType> param_dtype;   // all-gather, unsharded parameters and compute
  std::optional<DType> reduce_dtype;  // reduce-scatter / all-reduce, and no-sync accumulation
  std::optional<DType> output_dtype;  // cast floating forward outputs
  bool cast_forward_inputs = true;    // cast floating forward inputs to param_dtype
};

// Where sharded parameters, gradients and optimizer states live.
struct OffloadPolicy {
  virtual ~OffloadPolicy() = default;
  virtual bool offloads_to_cpu() const { return false; }
};

// Keep the sharded parameters, their gradients and so the optimizer's states
// in host memory (PyTorch's CPUOffloadPolicy): each all-gather copies this
// rank's shard to the device first, each reduce-scatter's result is copied
// back, and the optimizer steps on the host. The device then holds only the
// unsharded parameters while they are in use, and activations. On the CPU
// the shards already live in host memory, and the policy changes nothing.
// pin_memory is accepted: copies between host and GPU always go through the
// backend's page-locked staging buffers.
struct CPUOffloadPolicy : OffloadPolicy {
  bool pin_memory = true;
  explicit CPUOffloadPolicy(bool pin = true) : pin_memory(pin) {}
  bool offloads_to_cpu() const override { return true; }
};

// reshard_after_forward: true (free after forward, gather again in backward),
// false (keep unsharded until after backward), an int k (keep a 1/k slice
// after forward and gather over k ranks in backward), or unset (true for
// non-root modules, false for the root).
using ReshardAfterForward = std::variant<std::monostate, bool, int>;

struct FullyShardOptions {
  MeshPtr mesh;  // 1-D: FSDP; 2-D (replicate, shard): HSDP. Default: 1-D over the world.
  ReshardAfterForward reshard_after_forward;
  // Per parameter: Shard(d) to shard on dim d (needs the dim divisible by the
  // shard size when d > 0); std::nullopt for the default Shard(0).
  std::function<std::optional<Shard>(const Tensor&)> shard_placement_fn;
  MixedPrecisionPolicy mp_policy;
  std::shared_ptr<OffloadPolicy> offload_policy;
  // Parameters neither sharded nor reduced (compared by identity).
  std::vector<Tensor> ignored_params;
};

}  // namespace tessera::fsdp
