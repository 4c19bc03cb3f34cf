#include "train/parallelize.h"

#include "fsdp/fully_shard.h"
#include "runtime/distributed.h"
#include "tp/parallelize.h"

namespace tessera::train {

MeshDims mesh_dims(const ParallelismOptions& o, int world_size, const FieldNames& names) {
  auto f = [&](const char* field) { return field_name(names, field); };
  TS_CHECK(world_size >= 1, "mesh_dims: expected at least one rank, got {}", world_size);
  TS_CHECK(o.dp_replicate >= 1, "{} must be >= 1, got {}", f("dp_replicate"), o.dp_replicate);
  TS_CHECK(o.dp_shard == -1 || o.dp_shard >= 1, "{} must be -1 or >= 1, got {}", f("dp_shard"), o.dp_shard);
  TS_CHECK(o.tp >= 1, "{} must be >= 1, got {}", f("tp"), o.tp);
  MeshDims d;
  d.replicate = o.dp_replicate;
  d.tp = o.tp;
  d.shard = o.dp_shard;
  const CheckedInt others = named(f("dp_replicate"), o.dp_replicate) * named(f("tp"), o.tp);
  if (d.shard == -1) {
    TS_CHECK(world_size % others.value == 0, "{} ({}){} must divide the number of ranks ({})", f("dp_replicate"),
             o.dp_replicate, o.tp > 1 ? fmt::format(" x {} ({})", f("tp"), o.tp) : "", world_size);
    d.shard = world_size / others.value;
  }
  TS_CHECK((others * named(f("dp_shard"), d.shard)).value == world_size,
           "parallelism: replicate degree {} x shard degree {}{} = {} ranks, but the job has {}", d.replicate, d.shard,
           d.tp > 1 ? fmt::format(" x tensor-parallel degree {}", d.tp) : "", d.replicate * d.shard * d.tp,
           world_size);
  TS_CHECK(o.reshard_after_forward_degree == 0 ||
               (o.reshard_after_forward_degree >= 1 && d.shard % o.reshard_after_forward_degree == 0),
           "{} ({}) must divide the shard degree ({} at {} ranks), or be 0", f("reshard_after_forward_degree"),
           o.reshard_after_forward_degree, d.shard, world_size);
  TS_CHECK(!o.sequence_parallel || o.tp > 1,
           "{} splits activations over the tensor-parallel ranks: it needs {} > 1, got {}", f("sequence_parallel"),
           f("tp"), o.tp);
  auto dim = [&](int64_t size, const char* name) { d.shape.push_back(size), d.names.emplace_back(name); };
  if (d.replicate > 1) dim(d.replicate, "dp_replicate");
  dim(d.shard, "dp_shard");
  if (d.tp > 1) dim(d.tp, "tp");
  return d;
}

MeshPtr make_mesh(const ParallelismOptions& options, const std::string& device_type) {
  const MeshDims d = mesh_dims(options, dist::world_size());
  return init_device_mesh(device_type, d.shape, d.names);
}

void parallelize(nn::LanguageModel& model, const MeshPtr& mesh, const ParallelismOptions& o) {
  // Tensor parallelism first, over the innermost dim; FSDP over the others.
  MeshPtr dp = mesh;
  const auto& names = mesh->dim_names();
  if (names.back() == "tp") {
    tp::parallelize_module(model, (*mesh)["tp"],
                           tp::tensor_parallel_plan(model, mesh->size(-1), o.loss_parallel, o.sequence_parallel));
    dp = mesh->slice(std::vector<std::string>(names.begin(), names.end() - 1));
  }
  fsdp::FullyShardOptions opt{
      .mesh = dp,
      // true keeps PyTorch's default (the root stays unsharded after forward: it is needed first in backward)
      .reshard_after_forward =
          o.reshard_after_forward_degree > 0
              ? fsdp::ReshardAfterForward{static_cast<int>(o.reshard_after_forward_degree)}
          : o.reshard_after_forward ? fsdp::ReshardAfterForward{}
                                    : fsdp::ReshardAfterForward{false},
      .mp_policy = {.param_dtype = o.param_dtype, .reduce_dtype = o.reduce_dtype}};
  for (auto& block : model.blocks) fsdp::fully_shard(*block, opt);
  fsdp::fully_shard(model, opt);
  if (!o.prefetch) fsdp::set_prefetch(model, false);
}

}  // namespace tessera::train
