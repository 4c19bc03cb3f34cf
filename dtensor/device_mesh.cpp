#include "dtensor/device_mesh.h"

#include <algorithm>
#include <set>

#include "runtime/cuda_backend.h"

namespace tessera {

DeviceMesh::DeviceMesh(std::string device_type, Shape shape, std::vector<int> ranks,
                       std::vector<std::string> names, std::vector<dist::ProcessGroupPtr> groups,
                       std::vector<int64_t> coordinate)
    : device_type_(std::move(device_type)),
      shape_(std::move(shape)),
      ranks_(std::move(ranks)),
      names_(std::move(names)),
      groups_(std::move(groups)),
      coordinate_(std::move(coordinate)) {}

Device DeviceMesh::device() const {
  if (device_type_ == "cuda") return Device::cuda(dist::local_rank() % std::max(1, cuda::device_count()));
  return Device::parse(device_type_);
}

int64_t DeviceMesh::size() const { return shape_numel(shape_); }

int64_t DeviceMesh::size(int64_t dim) const { return shape_[static_cast<size_t>(wrap_dim(dim, ndim(), "DeviceMesh::size"))]; }

int64_t DeviceMesh::dim_index(const std::string& name) const {
  auto it = std::find(names_.begin(), names_.end(), name);
  TS_CHECK(it != names_.end(), "mesh has no dim named '{}' (dims: {})", name, fmt::join(names_, ", "));
  return it - names_.begin();
}

dist::ProcessGroupPtr DeviceMesh::get_group(int64_t dim) const {
  return groups_[static_cast<size_t>(wrap_dim(dim, ndim(), "DeviceMesh::get_group"))];
}

int64_t DeviceMesh::get_local_rank(int64_t dim) const {
  return coordinate_[static_cast<size_t>(wrap_dim(dim, ndim(), "DeviceMesh::get_local_rank"))];
}

MeshPtr DeviceMesh::root() const {
  return root_ ? root_ : std::const_pointer_cast<DeviceMesh>(shared_from_this());
}

MeshPtr DeviceMesh::slice(const std::vector<std::string>& names, bool any_order) const {
  TS_CHECK(!names.empty(), "mesh slice: give at least one dim name");
  // Each name is one dim of this mesh, or a registered flattening of several.
  struct Axis {
    std::vector<int64_t> dims;
    int64_t size, coordinate;
    dist::ProcessGroupPtr group;
  };
  std::vector<Axis> axes;
  std::vector<int64_t> dims;
  for (const auto& n : names) {
    Axis a;
    auto flat = flattened_.find(n);
    if (std::find(names_.begin(), names_.end(), n) == names_.end() && flat != flattened_.end()) {
      const MeshPtr& m = flat->second.mesh;
      a = {flat->second.dims, m->size(), m->get_local_rank(0), m->get_group(0)};
    } else {
      const int64_t d = dim_index(n);
      const size_t i = static_cast<size_t>(d);
      a = {{d}, shape_[i], coordinate_[i], groups_[i]};
    }
    dims.insert(dims.end(), a.dims.begin(), a.dims.end());
    axes.push_back(std::move(a));
  }
  for (size_t i = 1; i < dims.size(); ++i)
    TS_CHECK(any_order ? std::count(dims.begin(), dims.end(), dims[i]) == 1 : dims[i] > dims[i - 1],
             "mesh slice: dims ({}) must {} ({})", fmt::join(names, ", "),
             any_order ? "be distinct dims of the mesh" : "follow the mesh's order", fmt::join(names_, ", "));
  Shape shape;
  std::vector<dist::ProcessGroupPtr> groups;
  std::vector<int64_t> coord;
  for (const Axis& a : axes) shape.push_back(a.size), groups.push_back(a.group), coord.push_back(a.coordinate);
  // Ranks of this rank's slice: my coordinates on the other dims, all of the
  // selected ones (a flattened axis row-major over the dims it spans).
  std::vector<int> ranks;
  Shape strides = contiguous_strides(shape_);
  int64_t n = shape_numel(shape);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> c = coordinate_;
    int64_t rem = i;
    for (size_t k = axes.size(); k-- > 0;) {
      int64_t along = rem % axes[k].size;
      rem /= axes[k].size;
      for (size_t j = axes[k].dims.size(); j-- > 0;) {
        const size_t d = static_cast<size_t>(axes[k].dims[j]);
        c[d] = along % shape_[d];
        along /= shape_[d];
      }
    }
    int64_t linear = 0;
    for (size_t d = 0; d < c.size(); ++d) linear += c[d] * strides[d];
    ranks.push_back(ranks_[static_cast<size_t>(linear)]);
  }
  auto sliced = std::make_shared<DeviceMesh>(device_type_, shape, ranks, names, groups, coord);
  sliced->root_ = root();
  return sliced;
}

dist::ProcessGroupPtr DeviceMesh::flat_group() const {
  if (ndim() == 1) return groups_[0];
  if (!flat_ && groups_[0]->simulated()) {  // a planned rank: its place from its coordinate
    int64_t linear = 0;
    for (int64_t d = 0; d < ndim(); ++d) linear = linear * size(d) + coordinate_[static_cast<size_t>(d)];
    flat_ = dist::simulated_group(static_cast<int>(linear), ranks_, fmt::format("{}", fmt::join(names_, "_")));
  }
  if (!flat_) {
    int color = *std::min_element(ranks_.begin(), ranks_.end());
    int key = static_cast<int>(std::find(ranks_.begin(), ranks_.end(), dist::rank()) - ranks_.begin());
    flat_ = dist::world()->split(color, key, fmt::format("{}", fmt::join(names_, "_")));
    if (device_type_ == "cuda" && flat_ != nullptr && flat_->size() > 1) flat_ = cuda::nccl_group(flat_);
  }
  return flat_;
}

MeshPtr DeviceMesh::flatten(const std::string& name) const {
  std::string label = name.empty() ? fmt::format("{}", fmt::join(names_, "_")) : name;
  // The root dims this mesh spans, when they are all the root's own (a
  // flattening of a flattening is not registered).
  const MeshPtr top = root();
  std::vector<int64_t> dims;
  for (const std::string& n : names_) {
    const auto& all = top->names_;
    auto it = std::find(all.begin(), all.end(), n);
    if (it == all.end()) {
      dims.clear();
      break;
    }
    dims.push_back(it - all.begin());
  }
  if (!name.empty() && !dims.empty()) {
    TS_CHECK(std::is_sorted(dims.begin(), dims.end()),
             "DeviceMesh::flatten: '{}' would flatten dims ({}) out of the order of {}; slice them in its order",
             label, fmt::join(names_, ", "), top->str());
    auto known = top->flattened_.find(label);
    if (known != top->flattened_.end()) {
      TS_CHECK(known->second.dims == dims, "DeviceMesh::flatten: '{}' already names a flattening of other dims of {}",
               label, top->str());
      return known->second.mesh;
    }
    TS_CHECK(std::find(top->names_.begin(), top->names_.end(), label) == top->names_.end(),
             "DeviceMesh::flatten: '{}' is a dim of {} already", label, top->str());
  }
  const int64_t me = flat_group()->rank();  // row-major over this mesh's dims (a planned rank's too)
  auto flat = std::make_shared<DeviceMesh>(device_type_, Shape{size()}, ranks_, std::vector<std::string>{label},
                                           std::vector<dist::ProcessGroupPtr>{flat_group()}, std::vector<int64_t>{me});
  if (!name.empty() && !dims.empty()) top->flattened_[label] = {dims, flat};
  return flat;
}

MeshPtr DeviceMesh::unflatten(const std::string& name, const Shape& sizes, const std::vector<std::string>& names) const {
  const int64_t d = dim_index(name);
  TS_CHECK(!sizes.empty() && sizes.size() == names.size(),
           "DeviceMesh::unflatten: {} sizes for {} names (splitting '{}' of {})", sizes.size(), names.size(), name,
           str());
  for (int64_t s : sizes)
    TS_CHECK(s > 0, "DeviceMesh::unflatten: sizes {} must be positive (splitting '{}' of {})", shape_str(sizes), name,
             str());
  TS_CHECK(shape_numel(sizes) == shape_[static_cast<size_t>(d)],
           "DeviceMesh::unflatten: sizes {} hold {} ranks, but '{}' of {} has {}", shape_str(sizes),
           shape_numel(sizes), name, str(), shape_[static_cast<size_t>(d)]);
  std::vector<std::string> all_names;
  Shape shape;
  std::vector<dist::ProcessGroupPtr> groups;
  std::vector<int64_t> coordinate;
  const dist::ProcessGroupPtr parent = get_group(d);
  const int64_t along = coordinate_[static_cast<size_t>(d)];  // this rank's place in `parent`
  for (int64_t k = 0; k < ndim(); ++k) {
    if (k != d) {
      all_names.push_back(names_[static_cast<size_t>(k)]);
      shape.push_back(shape_[static_cast<size_t>(k)]);
      groups.push_back(groups_[static_cast<size_t>(k)]);
      coordinate.push_back(coordinate_[static_cast<size_t>(k)]);
      continue;
    }
    for (size_t j = 0; j < sizes.size(); ++j) {
      int64_t stride = 1;
      for (size_t i = j + 1; i < sizes.size(); ++i) stride *= sizes[i];
      const int64_t mine = along / stride % sizes[j], first = along - mine * stride;
      // The ranks of `parent` that differ from this one along new dim j only.
      std::vector<int> members;
      for (int64_t i = 0; i < sizes[j]; ++i) members.push_back(static_cast<int>(first + i * stride));
      dist::ProcessGroupPtr g;
      if (parent->simulated()) {
        g = parent->new_group(members, names[j]);
      } else {  // split from the world, as flat_group: the lowest global rank names each new group
        g = dist::world()->split(parent->global_ranks()[static_cast<size_t>(first)], static_cast<int>(mine), names[j]);
        if (device_type_ == "cuda" && g->size() > 1) g = cuda::nccl_group(g);
      }
      all_names.push_back(names[j]);
      shape.push_back(sizes[j]);
      groups.push_back(std::move(g));
      coordinate.push_back(mine);
    }
  }
  TS_CHECK(std::set<std::string>(all_names.begin(), all_names.end()).size() == all_names.size(),
           "DeviceMesh::unflatten: the dims ({}) must be unique", fmt::join(all_names, ", "));
  return std::make_shared<DeviceMesh>(device_type_, shape, ranks_, all_names, groups, coordinate);
}

std::string DeviceMesh::str() const {
  return fmt::format("DeviceMesh({}, {}, ({}))", device_type_, shape_str(shape_), fmt::join(names_, ", "));
}

MeshPtr init_device_mesh(const std::string& device_type, const Shape& shape,
                         const std::vector<std::string>& dim_names) {
  dist::init();
  TS_CHECK(device_type == "cpu" || device_type == "async_cpu" || device_type == "cuda",
           "init_device_mesh: unknown device type '{}' (cpu, cuda, async_cpu)", device_type);
  if (device_type == "cuda")
    TS_CHECK(cuda::is_available(), "init_device_mesh: device type 'cuda', but {} (docs/gpu.md)",
             cuda::unavailable_reason());
  TS_CHECK(!shape.empty(), "init_device_mesh: the mesh needs at least one dim");
  for (int64_t s : shape) TS_CHECK(s > 0, "init_device_mesh: mesh shape {} has a non-positive dim", shape_str(shape));
  TS_CHECK(shape_numel(shape) == dist::world_size(),
           "init_device_mesh: mesh shape {} holds {} ranks but the world has {}", shape_str(shape),
           shape_numel(shape), dist::world_size());
  std::vector<std::string> names = dim_names;
  if (names.empty())
    for (size_t i = 0; i < shape.size(); ++i) names.push_back("dim_" + std::to_string(i));
  TS_CHECK(names.size() == shape.size(), "init_device_mesh: {} dim names for a {}-d mesh", names.size(),
           shape.size());
  TS_CHECK(std::set<std::string>(names.begin(), names.end()).size() == names.size(),
           "init_device_mesh: dim names ({}) must be unique", fmt::join(names, ", "));
  // Row-major coordinate of this rank.
  std::vector<int64_t> coord(shape.size());
  int64_t rem = dist::rank();
  for (size_t d = shape.size(); d-- > 0;) {
    coord[d] = rem % shape[d];
    rem /= shape[d];
  }
  std::vector<dist::ProcessGroupPtr> groups;
  auto world = dist::world();
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape.size() == 1) {  // a 1-D mesh over the world reuses the world group
      groups.push_back(world);
      continue;
    }
    // Ranks that share every other coordinate form the group of dim d.
    int64_t color = 0;
    for (size_t k = 0; k < shape.size(); ++k)
      if (k != d) color = color * shape[k] + coord[k];
    groups.push_back(world->split(static_cast<int>(color), static_cast<int>(coord[d]), names[d]));
  }
  // CUDA tensors move over NCCL: each dim's group gets a communicator.
  if (device_type == "cuda" && dist::world_size() > 1)
    for (auto& g : groups) g = cuda::nccl_group(g);
  std::vector<int> ranks(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
  return std::make_shared<DeviceMesh>(device_type, shape, ranks, names, groups, coord);
}

}  // namespace tessera
