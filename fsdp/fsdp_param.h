// FSDPParam: one parameter's sharded and unsharded life (PyTorch:
// _fsdp_param.py).
//
//   sharded_data      1-D, padded: this rank's torch.chunk piece, zero-padded to
//                     ceil(n/W) rows; the all-gather input, in the original dtype
//   sharded_param     the DTensor registered on the module while sharded; its local
//                     tensor is the unpadded narrow of sharded_data; the optimizer
//                     steps on it
//   unsharded_buffer  1-D [W * padded numel] in param_dtype; its storage is released
//                     when resharded and re-allocated (same tensor objects) on unshard
//   unsharded_param   the full parameter registered during compute: a leaf viewing
//                     unsharded_buffer (Shard(0)), created once, so tensors autograd
//                     saved during forward see the bytes gathered again in backward
//
// With CPUOffloadPolicy (offload_to_cpu) on a device the host cannot read
// (CUDA, async_cpu), sharded_data, the sharded parameter and its gradient
// live in host memory: the all-gather input is copied to compute_device on
// the copy-in stream, the reduced gradient is copied back on the
// reduce-scatter stream, and the optimizer steps on the host. On the CPU the
// policy changes nothing (the shards already live there).
//
// Over tensor parallelism (a parameter that parallelize_module made a DTensor
// on a 1-D tensor-parallel mesh) FSDP shards, gathers and reduces that
// DTensor's local tensor: unsharded_local is the gathered local tensor, and
// unsharded_param wraps it as the tensor-parallel DTensor again, so the
// module computes with it as without FSDP. The sharded parameter lives on the
// mesh (tp, FSDP's dims), its shards nested inside the tensor-parallel ones
// (PyTorch's 2-D FSDP + TP; its _StridedShard).
#pragma once

#include "fsdp/policies.h"
#include "nn/module.h"

namespace tessera::fsdp {

enum class ShardedState { Sharded, ShardedPostForward, Unsharded };

// The process groups FSDP uses (PyTorch: FSDPMeshInfo / HSDPMeshInfo).
struct MeshInfo {
  MeshPtr mesh;
  dist::ProcessGroupPtr shard_group;
  int shard_size = 1, shard_rank = 0;
  dist::ProcessGroupPtr replicate_group;  // HSDP only
  int replicate_size = 1, replicate_rank = 0;
  bool hsdp() const { return replicate_group != nullptr; }
};

// Where a parameter is registered: every (module, name) holding it (tied
// parameters are held by several).
struct ParamSlot {
  nn::Module* module;
  std::string name;
};

class FSDPParam {
 public:
  FSDPParam(const Tensor& param, std::vector<ParamSlot> slots, const MeshInfo& mesh_info, Shard placement,
            std::string fqn, bool offload_to_cpu = false);

  // Sizes.
  const std::string fqn;
  Shape orig_size;
  DType orig_dtype;
  int64_t shard_dim;
  Shape sharded_size;         // this rank's unpadded chunk
  Shape padded_sharded_size;  // ceil(n/W) on shard_dim
  int64_t padded_numel = 0;   // per rank, all-gather / reduce-scatter unit
  bool requires_grad = false;
  DType param_dtype;   // after clamping: the dtype of the unsharded parameter
  DType reduce_dtype;  // after clamping: the dtype gradients are reduced in
  bool offload_to_cpu = false;  // CPUOffloadPolicy
  Device compute_device;        // where the parameter is gathered and computed with
  // Where the sharded state lives: the host when offloaded, else compute_device.
  bool offloaded() const { return offload_to_cpu && !compute_device.is_host_visible() && !compute_device.is_meta(); }

  void init_dtype_attrs(const MixedPrecisionPolicy& mp);

  // Tensors (see the file comment).
  Tensor sharded_data;
  Tensor sharded_param;
  Tensor unsharded_buffer;
  Tensor unsharded_param;
  Tensor unsharded_local;  // unsharded_param's bytes (unsharded_param itself without TP)

  // Tensor parallelism: the parameter's DTensor layout before fully_shard (null mesh: a plain parameter).
  MeshPtr tp_mesh;
  Placements tp_placements;
  Shape tp_shape;
  // A gradient of unsharded_param as a local tensor (a DTensor's, laid out as the parameter).
  Tensor local_grad(const Tensor& grad) const;
  Tensor unsharded_accumulated_grad;  // reduce_dtype, across no-sync micro-batches
  Tensor post_forward_data;           // int reshard_after_forward: this rank's 1/k slice

  ShardedState state = ShardedState::Sharded;

  // The all-gather input: sharded_data in param_dtype (a copy when the dtypes differ).
  Tensor all_gather_input() const;
  // Makes unsharded_buffer's bytes exist (first call creates the tensors).
  void alloc_unsharded();
  void free_unsharded();
  // Registers the sharded DTensor (and frees the unsharded bytes).
  void to_sharded();
  // Keeps this rank's 1/k slice of the gathered parameter, then frees the rest.
  void to_sharded_post_forward(int k, int index);
  // Registers the unsharded parameter (the bytes must be there).
  void to_unsharded();
  // After the module's tensors were replaced (to_empty, to(dtype), load with
  // assign): re-reads the registered DTensor and re-pads it.
  void reset_sharded_param();

 private:
  void register_all(const Tensor& value);
  Tensor current_registered() const;
  std::vector<ParamSlot> slots_;
  MeshInfo mesh_info_;
};

}  // namespace tessera::fsdp
