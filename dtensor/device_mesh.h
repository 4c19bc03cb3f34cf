// DeviceMesh: an n-D array of ranks with named dims. Each mesh dim has a
// process group over the ranks that differ only along it (this rank's row);
// slicing a mesh by names gives a submesh that reuses those groups, and
// flattening several dims creates one new group over their ranks.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/distributed.h"
#include "runtime/tensor.h"

namespace tessera {

class DeviceMesh;
using MeshPtr = std::shared_ptr<DeviceMesh>;

class DeviceMesh : public std::enable_shared_from_this<DeviceMesh> {
 public:
  // Use init_device_mesh; this constructor wires given groups (one per dim).
  DeviceMesh(std::string device_type, Shape shape, std::vector<int> ranks, std::vector<std::string> names,
             std::vector<dist::ProcessGroupPtr> groups, std::vector<int64_t> coordinate);

  const std::string& device_type() const { return device_type_; }
  Device device() const;
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  const Shape& shape() const { return shape_; }
  int64_t size() const;            // number of ranks
  int64_t size(int64_t dim) const;  // ranks along one dim
  const std::vector<std::string>& dim_names() const { return names_; }
  int64_t dim_index(const std::string& name) const;  // throws naming the valid names
  const std::vector<int>& ranks() const { return ranks_; }  // global ranks, row-major

  dist::ProcessGroupPtr get_group(int64_t dim) const;
  dist::ProcessGroupPtr get_group(const std::string& name) const { return get_group(dim_index(name)); }
  int64_t get_local_rank(int64_t dim) const;  // this rank's coordinate along dim
  int64_t get_local_rank(const std::string& name) const { return get_local_rank(dim_index(name)); }
  const std::vector<int64_t>& get_coordinate() const { return coordinate_; }

  // Submesh of one or several dims (in this mesh's order), for this rank's
  // slice. any_order: the dims in the order given (FSDP over tensor
  // parallelism nests its shards inside the tensor-parallel ones).
  MeshPtr operator[](const std::string& name) const { return slice({name}); }
  MeshPtr slice(const std::vector<std::string>& names, bool any_order = false) const;
  // The mesh this one was sliced from (itself for a mesh made by init_device_mesh).
  MeshPtr root() const;
  // A 1-D mesh over all ranks of this mesh with a new process group (collective
  // over the world: every rank calls it). Named `name` (default "a_b"). The
  // flattening of dims of a root mesh is registered on the root under that
  // name, and the root then slices it like one of its own dims, alone or with
  // others (PyTorch's _flatten: TorchTitan shards FSDP over "dp_shard_cp",
  // the data and context dims flattened, next to "tp"). Flattening the same
  // dims under the same name again returns the registered mesh.
  MeshPtr flatten(const std::string& name = "") const;
  // A new root mesh over the same ranks with dim `name` split into dims
  // `names` of sizes `sizes` (their product its size; row-major: the last
  // varies fastest along it), as PyTorch's DeviceMesh._unflatten: TorchTitan
  // carves expert parallelism out of the data-parallel ranks, dp_shard ->
  // (dp_shard_mod_ep, ep). The other dims keep their groups; each new dim gets
  // a group over the ranks of the old dim's that differ along it only
  // (collective over the world, as flatten: every rank calls it; a simulated
  // mesh's groups stay simulated).
  MeshPtr unflatten(const std::string& name, const Shape& sizes, const std::vector<std::string>& names) const;
  // The group of all ranks of this mesh (created on first use; collective).
  dist::ProcessGroupPtr flat_group() const;

  std::string str() const;  // "DeviceMesh(cpu, [2, 2], ('replicate', 'shard'))"
  friend bool operator==(const DeviceMesh& a, const DeviceMesh& b) {
    return a.ranks_ == b.ranks_ && a.shape_ == b.shape_ && a.names_ == b.names_;
  }

 private:
  std::string device_type_;
  Shape shape_;
  std::vector<int> ranks_;
  std::vector<std::string> names_;
  std::vector<dist::ProcessGroupPtr> groups_;
  std::vector<int64_t> coordinate_;
  mutable dist::ProcessGroupPtr flat_;
  MeshPtr root_;  // null: this mesh is a root
  // On a root: its named flattenings, each the root dims it spans (in order) and the 1-D mesh.
  struct Flattened {
    std::vector<int64_t> dims;
    MeshPtr mesh;
  };
  mutable std::map<std::string, Flattened> flattened_;
};

// An n-D mesh over all ranks (product of shape == world size), row-major as
// torch.arange(world).view(shape). Collective: every rank calls it.
MeshPtr init_device_mesh(const std::string& device_type, const Shape& shape,
                         const std::vector<std::string>& dim_names = {});

}  // namespace tessera
