#include "dtensor/dtensor.h"

#include <algorithm>

#include "autograd/tape.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules.h"
#include "runtime/ops.h"
#include "runtime/random.h"

namespace tessera {

std::string DTensorSpec::str() const {
  return fmt::format("DTensor({}, placements {}, global {}, local {})", mesh->str(), placements_str(placements),
                     shape_str(global_shape), shape_str(local.shape()));
}

std::string DTensorSpec::no_bytes_hint() const {
  return "use its local tensor (to_local()); if it is an FSDP parameter, run the module as module(x) (forward(x) "
         "skips the hooks that unshard it)";
}

const DTensorSpec& dtensor_spec(const Tensor& t) {
  TS_CHECK(t.defined() && t.is_subclass(), "expected a DTensor, got a plain tensor {}",
           t.defined() ? shape_str(t.shape()) : "(undefined)");
  auto* spec = dynamic_cast<const DTensorSpec*>(t.impl()->subclass.get());
  TS_CHECK(spec != nullptr, "tensor carries a subclass that is not a DTensorSpec");
  return *spec;
}

std::vector<Runs> local_runs(const Shape& global, const DeviceMesh& mesh, const Placements& placements,
                             const std::vector<int64_t>& coordinate) {
  std::vector<Runs> runs;
  for (int64_t n : global) runs.push_back(n > 0 ? Runs{{0, n}} : Runs{});
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!is_shard(placements[i])) continue;
    auto d = static_cast<size_t>(shard_dim(placements[i]));
    runs[d] = shard_runs(runs[d], placements[i], mesh.size(static_cast<int64_t>(i)), coordinate[i]);
  }
  return runs;
}

Shape local_shape(const Shape& global, const DeviceMesh& mesh, const Placements& placements,
                  const std::vector<int64_t>& coordinate) {
  Shape local = global;
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!is_shard(placements[i])) continue;
    auto d = static_cast<size_t>(shard_dim(placements[i]));
    local[d] = shard_length(local[d], placements[i], mesh.size(static_cast<int64_t>(i)), coordinate[i]);
  }
  return local;
}

namespace {
bool any_blocked(const Placements& placements) {
  return std::any_of(placements.begin(), placements.end(), [](const Placement& p) { return is_blocked(p); });
}
}  // namespace

std::pair<Shape, Shape> local_shape_and_offset(const Shape& global, const DeviceMesh& mesh,
                                               const Placements& placements,
                                               const std::vector<int64_t>& coordinate) {
  Shape local = global, offset(global.size(), 0);
  if (any_blocked(placements)) {
    const std::vector<Runs> runs = local_runs(global, mesh, placements, coordinate);
    for (size_t d = 0; d < runs.size(); ++d) {
      TS_CHECK(runs[d].size() <= 1, "{} on {}: dim {} of this rank's piece is {} runs of the global tensor, not one "
               "box (a blocked shard); take them one by one (local_runs, local_boxes)",
               placements_str(placements), shape_str(global), d, runs[d].size());
      local[d] = runs[d].empty() ? 0 : runs[d][0].second;
      offset[d] = runs[d].empty() ? 0 : runs[d][0].first;
    }
    return {local, offset};
  }
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!is_shard(placements[i])) continue;
    auto d = static_cast<size_t>(shard_dim(placements[i]));
    auto [len, start] = shard_size_and_offset(local[d], mesh.size(static_cast<int64_t>(i)), coordinate[i]);
    local[d] = len;
    offset[d] += start;
  }
  return {local, offset};
}

std::vector<LocalBox> local_boxes(const Tensor& t) {
  if (!is_dtensor(t) || !any_blocked(dtensor_spec(t).placements)) return {local_box(t)};
  const DTensorSpec& spec = dtensor_spec(t);
  const std::vector<Runs> runs = local_runs(spec.global_shape, *spec.mesh, spec.placements,
                                            spec.mesh->get_coordinate());
  const size_t nd = runs.size();
  for (const Runs& r : runs)
    if (r.empty()) return {{spec.local, Shape(nd, 0), spec.local.shape()}};
  // Every combination of one run per dim, with where each starts locally.
  std::vector<LocalBox> boxes;
  std::vector<size_t> pick(nd, 0);
  while (true) {
    LocalBox box{spec.local, Shape(nd), Shape(nd)};
    for (size_t d = 0; d < nd; ++d) {
      int64_t at = 0;
      for (size_t j = 0; j < pick[d]; ++j) at += runs[d][j].second;
      box.offset[d] = runs[d][pick[d]].first;
      box.shape[d] = runs[d][pick[d]].second;
      if (box.shape[d] != spec.local.size(static_cast<int64_t>(d)))
        box.local = ops::narrow(box.local, static_cast<int64_t>(d), at, box.shape[d]);
    }
    boxes.push_back(std::move(box));
    size_t d = nd;
    while (d > 0 && ++pick[d - 1] == runs[d - 1].size()) pick[--d] = 0;
    if (d == 0) break;
  }
  return boxes;
}

LocalBox local_box(const Tensor& t) {
  if (!is_dtensor(t)) return {t, Shape(t.shape().size(), 0), t.shape()};
  const DTensorSpec& spec = dtensor_spec(t);
  auto [shape, offset] =
      local_shape_and_offset(spec.global_shape, *spec.mesh, spec.placements, spec.mesh->get_coordinate());
  return {spec.local, offset, shape};
}

Placements normalize_placements(const Placements& placements, const DeviceMesh& mesh, int64_t ndim,
                                const char* op) {
  TS_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(),
           "{}: {} placements {} for a {}-d mesh (one per mesh dim)", op, placements.size(),
           placements_str(placements), mesh.ndim());
  Placements out = placements;
  for (auto& p : out) {
    if (!is_shard(p)) continue;
    int64_t d = shard_dim(p);
    TS_CHECK(d >= -ndim && d < ndim, "{}: {} is out of range for a {}-d tensor", op, placement_str(p), ndim);
    TS_CHECK(shard_blocks(p) >= 1, "{}: {} needs at least one block", op, placement_str(p));
    p = Shard{d < 0 ? d + ndim : d, shard_blocks(p)};
  }
  return out;
}

Tensor make_dtensor(const Tensor& local, MeshPtr mesh, Placements placements, Shape global_shape) {
  TS_CHECK(local.defined() && !is_dtensor(local), "make_dtensor: the local tensor must be a plain tensor");
  auto expected = local_shape(global_shape, *mesh, placements, mesh->get_coordinate());
  TS_CHECK(local.shape() == expected,
           "DTensor: local shape {} does not match the shard {} of global shape {} with placements {} on {}",
           shape_str(local.shape()), shape_str(expected), shape_str(global_shape), placements_str(placements),
           mesh->str());
  auto spec = std::make_shared<DTensorSpec>();
  spec->mesh = std::move(mesh);
  spec->placements = std::move(placements);
  spec->global_shape = global_shape;
  spec->local = local;
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = global_shape;
  impl->strides = contiguous_strides(global_shape);
  impl->dtype = local.dtype();
  impl->device = local.device();
  impl->subclass = std::move(spec);
  detail::register_sharding_rules();  // before the first op on a DTensor
  return Tensor(std::move(impl));
}

namespace {
Tensor piece_of(const Tensor& full, const DeviceMesh& mesh, const Placements& placements) {
  const std::vector<Runs> runs = local_runs(full.shape(), mesh, placements, mesh.get_coordinate());
  Tensor piece = full;
  for (size_t d = 0; d < runs.size(); ++d) {
    const auto dim = static_cast<int64_t>(d);
    if (runs[d].size() == 1 && runs[d][0].second == full.size(dim)) continue;
    std::vector<Tensor> parts;
    for (const auto& [start, len] : runs[d]) parts.push_back(ops::narrow(piece, dim, start, len));
    piece = runs[d].empty() ? ops::narrow(piece, dim, 0, 0) : parts.size() == 1 ? parts[0] : ops::cat(parts, dim);
  }
  return ops::clone(piece);
}

Placements partial_as_replicate(const Placements& ps) {
  Placements out = ps;
  for (auto& p : out)
    if (is_partial(p)) p = Replicate{};
  return out;
}
}  // namespace

Tensor distribute_parameter(const Tensor& t, MeshPtr mesh, const Placements& placements, const char* op) {
  TS_CHECK(!is_dtensor(t), "{}: a parameter is already a DTensor ({}); apply tensor and expert parallelism before "
           "fully_shard, once per module", op, dtensor_spec(t).str());
  Tensor out;
  if (t.is_meta()) {
    Placements ps = normalize_placements(placements, *mesh, t.dim(), op);
    const Shape shape = local_shape(t.shape(), *mesh, ps, mesh->get_coordinate());
    out = make_dtensor(empty(shape, t.dtype(), Device::meta()), mesh, ps, t.shape());
  } else {
    autograd::NoGradGuard no_grad;
    out = distribute_tensor(t, mesh, placements);
  }
  out.set_requires_grad(t.requires_grad());
  return out;
}

Tensor distribute_tensor_local(const Tensor& full, MeshPtr mesh, const Placements& placements_in) {
  TS_CHECK(!is_dtensor(full), "distribute_tensor: the input is already a DTensor");
  Placements placements = normalize_placements(placements_in, *mesh, full.dim(), "distribute_tensor");
  for (const auto& p : placements)
    TS_CHECK(!is_partial(p), "distribute_tensor: {} is not allowed (Shard or Replicate only)", placement_str(p));
  Tensor out = make_dtensor(piece_of(full, *mesh, placements), mesh, placements, full.shape());
  if (full.requires_grad()) out.set_requires_grad(true);
  return out;
}

Tensor distribute_tensor(const Tensor& full, MeshPtr mesh, const Placements& placements) {
  Tensor source = ops::contiguous(full);
  if (mesh->size() > 1) {
    source = ops::clone(source);
    mesh->flat_group()->broadcast(source, 0)->wait();  // mesh rank 0 is the source of truth
  }
  Tensor out = distribute_tensor_local(source, mesh, placements);
  if (full.requires_grad()) out.set_requires_grad(true);
  return out;
}

Tensor from_local(const Tensor& local, MeshPtr mesh, const Placements& placements_in,
                  std::optional<Shape> global_shape) {
  Placements placements = normalize_placements(placements_in, *mesh, local.dim(), "from_local");
  Shape global = local.shape();
  if (global_shape) {
    global = *global_shape;
  } else {
    for (size_t i = 0; i < placements.size(); ++i)
      if (is_shard(placements[i])) global[static_cast<size_t>(shard_dim(placements[i]))] *= mesh->size(static_cast<int64_t>(i));
  }
  Tensor out = make_dtensor(autograd::detach(local), mesh, placements, global);
  if (autograd::should_record({local})) {
    Placements back = partial_as_replicate(placements);
    autograd::record("from_local", {local}, {out}, [back](const TensorList& g) {
      return TensorList{local_tensor(redistribute_local(g[0], back))};
    });
  }
  return out;
}

Tensor to_local(const Tensor& dt, std::optional<Placements> grad_placements) {
  const DTensorSpec& spec = dtensor_spec(dt);
  Tensor out = ops::alias(spec.local);
  if (autograd::should_record({dt})) {
    MeshPtr mesh = spec.mesh;
    Placements gp = grad_placements.value_or(spec.placements);
    Shape global = spec.global_shape;
    autograd::record("to_local", {dt}, {out}, [mesh, gp, global](const TensorList& g) {
      return TensorList{make_dtensor(ops::contiguous(g[0]), mesh, gp, global)};
    });
  }
  return out;
}

Tensor redistribute(const Tensor& dt, const Placements& placements) {
  const DTensorSpec& spec = dtensor_spec(dt);
  Tensor out = redistribute_local(dt, placements);
  if (autograd::should_record({dt})) {
    if (out.is_same(dt)) out = make_dtensor(spec.local, spec.mesh, spec.placements, spec.global_shape);
    Placements back = partial_as_replicate(spec.placements);
    autograd::record("redistribute", {dt}, {out},
                     [back](const TensorList& g) { return TensorList{redistribute_local(g[0], back)}; });
  }
  return out;
}

Tensor full_tensor(const Tensor& dt, std::optional<Placements> grad_placements) {
  const DTensorSpec& spec = dtensor_spec(dt);
  Placements all(spec.placements.size(), Replicate{});
  return to_local(redistribute(dt, all), grad_placements);
}

}  // namespace tessera
