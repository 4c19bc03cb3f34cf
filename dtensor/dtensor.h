// DTensor: a local tensor plus a spec (mesh, one placement per mesh dim,
// global shape). To the code above it a DTensor *is a* Tensor: its impl has
// the global shape, no bytes of its own, and carries the spec as a tensor
// subclass (runtime/tensor.h); raw ops on it reach the sharding rules of
// dtensor/rules*.cpp by op id through runtime/op_call.h.
#pragma once

#include <optional>

#include "autograd/tape.h"
#include "dtensor/device_mesh.h"
#include "dtensor/placement.h"

namespace tessera {

struct DTensorSpec final : TensorSubclass {
  MeshPtr mesh;
  Placements placements;
  Shape global_shape;
  Tensor local;
  std::string str() const override;
  std::string no_bytes_hint() const override;
};

// Whether t is a DTensor (the only tensor subclass Tensor has).
inline bool is_dtensor(const Tensor& t) { return t.is_subclass(); }

// The spec of a DTensor (throws for plain tensors).
const DTensorSpec& dtensor_spec(const Tensor& t);

// Local shape of the shard at `coordinate`.
Shape local_shape(const Shape& global, const DeviceMesh& mesh, const Placements& placements,
                  const std::vector<int64_t>& coordinate);
// Local shape and global offset (per tensor dim) of the shard at `coordinate`;
// throws where a blocked Shard makes the shard several boxes (local_runs).
std::pair<Shape, Shape> local_shape_and_offset(const Shape& global, const DeviceMesh& mesh,
                                               const Placements& placements,
                                               const std::vector<int64_t>& coordinate);
// Per tensor dim, the runs of global indices the shard at `coordinate`
// covers, in local order: one run, or one per block of a blocked Shard.
std::vector<Runs> local_runs(const Shape& global, const DeviceMesh& mesh, const Placements& placements,
                             const std::vector<int64_t>& coordinate);
// This rank's piece of t: its local tensor and the box [offset, offset + shape)
// that piece covers in the global tensor (a plain tensor is its own whole box).
struct LocalBox {
  Tensor local;
  Shape offset, shape;
};
LocalBox local_box(const Tensor& t);  // throws for a blocked Shard's several boxes
// Every box of this rank's piece (one unless a blocked Shard splits it), each
// with its view of the local tensor: what a checkpoint writes and reads.
std::vector<LocalBox> local_boxes(const Tensor& t);
// Checks placements against a mesh and a global shape (dims in range, one per mesh dim).
Placements normalize_placements(const Placements& placements, const DeviceMesh& mesh, int64_t ndim,
                                const char* op);

// Wraps a local tensor (no communication, no autograd). Shard dims must be
// normalised (non-negative).
Tensor make_dtensor(const Tensor& local, MeshPtr mesh, Placements placements, Shape global_shape);

// Cuts `full` (every rank passes the full shape; the values of mesh rank 0
// are used: they are broadcast first) into this rank's piece. Shard and
// Replicate only. The result is a leaf that requires grad if `full` does.
Tensor distribute_tensor(const Tensor& full, MeshPtr mesh, const Placements& placements);
// Same, without communication: every rank already holds the same full tensor.
Tensor distribute_tensor_local(const Tensor& full, MeshPtr mesh, const Placements& placements);
// A module's parameter laid out by `placements` (tensor and expert
// parallelism): a meta tensor gets a meta shard of the right shape (bytes
// come at to_empty), a real one is cut from mesh rank 0's values. Keeps
// requires_grad; `op` names the caller in errors (a DTensor is refused).
Tensor distribute_parameter(const Tensor& t, MeshPtr mesh, const Placements& placements, const char* op);

// A DTensor from this rank's local piece. Without global_shape, shards are
// assumed even (local size x mesh size on sharded dims), as in PyTorch; pass
// the global shape for uneven shards. Differentiable.
Tensor from_local(const Tensor& local, MeshPtr mesh, const Placements& placements,
                  std::optional<Shape> global_shape = std::nullopt);
// The local tensor (differentiable: its gradient becomes a DTensor with
// grad_placements, default the forward placements).
Tensor to_local(const Tensor& dtensor, std::optional<Placements> grad_placements = std::nullopt);
// The whole tensor on every rank (redistribute to Replicate, then to_local).
Tensor full_tensor(const Tensor& dtensor, std::optional<Placements> grad_placements = std::nullopt);
// Changes placements with the collectives each transition needs. Differentiable:
// the gradient is redistributed back to the source placements (Partial taken
// as Replicate).
Tensor redistribute(const Tensor& dtensor, const Placements& placements);

// The local tensor without autograd (for optimizers, FSDP internals).
inline const Tensor& local_tensor(const Tensor& dtensor) { return dtensor_spec(dtensor).local; }

}  // namespace tessera
