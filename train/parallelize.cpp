#include "train/parallelize.h"

#include <algorithm>

#include "cp/context_parallel.h"
#include "ep/expert_parallel.h"
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
  TS_CHECK(o.pp >= 1, "{} must be >= 1, got {}", f("pp"), o.pp);
  TS_CHECK(o.cp >= 1, "{} must be >= 1, got {}", f("cp"), o.cp);
  TS_CHECK(o.ep >= 1, "{} must be >= 1, got {}", f("ep"), o.ep);
  cp::parse_rotate_method(o.cp_rotate_method, f("cp_rotate_method"));

  MeshDims d;
  d.pp = o.pp;
  d.replicate = o.dp_replicate;
  d.cp = o.cp;
  d.tp = o.tp;
  d.shard = o.dp_shard;
  const CheckedInt others = named(f("pp"), o.pp) * named(f("dp_replicate"), o.dp_replicate) * named(f("cp"), o.cp) *
                            named(f("tp"), o.tp);
  if (d.shard == -1) {
    TS_CHECK(world_size % others.value == 0, "{}{} ({}){}{} must divide the number of ranks ({})",
             o.pp > 1 ? fmt::format("{} ({}) x ", f("pp"), o.pp) : "", f("dp_replicate"), o.dp_replicate,
             o.cp > 1 ? fmt::format(" x {} ({})", f("cp"), o.cp) : "",
             o.tp > 1 ? fmt::format(" x {} ({})", f("tp"), o.tp) : "", world_size);
    d.shard = world_size / others.value;
  }
  TS_CHECK((others * named(f("dp_shard"), d.shard)).value == world_size,
           "parallelism: {}replicate degree {} x shard degree {}{}{} = {} ranks, but the job has {}",
           d.pp > 1 ? fmt::format("pipeline degree {} x ", d.pp) : "", d.replicate, d.shard,
           d.cp > 1 ? fmt::format(" x context-parallel degree {}", d.cp) : "",
           d.tp > 1 ? fmt::format(" x tensor-parallel degree {}", d.tp) : "",
           d.pp * d.replicate * d.shard * d.cp * d.tp, world_size);
  // FSDP shards over data x context.
  TS_CHECK(o.reshard_after_forward_degree == 0 ||
               (o.reshard_after_forward_degree >= 1 && d.shard * d.cp % o.reshard_after_forward_degree == 0),
           "{} ({}) must divide the shard degree ({} at {} ranks{}), or be 0", f("reshard_after_forward_degree"),
           o.reshard_after_forward_degree, d.shard * d.cp, world_size,
           d.cp > 1 ? fmt::format(": data {} x context {}", d.shard, d.cp) : "");
  d.ep = o.ep;
  TS_CHECK(d.shard % o.ep == 0,
           "{} ({}) must divide the shard degree {} ({} at {} ranks): the expert-parallel ranks are data-parallel "
           "ranks, each holding moe_experts / {} experts",
           f("ep"), o.ep, f("dp_shard"), d.shard, world_size, f("ep"));
  TS_CHECK(o.ep == 1 || (o.pp == 1 && o.cp == 1),
           "{} ({}) composes with FSDP, HSDP and tensor parallelism so far; with {} ({}) or {} ({}) it is not "
           "written yet", f("ep"), o.ep, f("pp"), o.pp, f("cp"), o.cp);
  TS_CHECK(!o.sequence_parallel || o.tp > 1,
           "{} splits activations over the tensor-parallel ranks: it needs {} > 1, got {}", f("sequence_parallel"),
           f("tp"), o.tp);
  auto dim = [&](int64_t size, const char* name) { d.shape.push_back(size), d.names.emplace_back(name); };
  if (d.pp > 1) dim(d.pp, "pp");
  if (d.replicate > 1) dim(d.replicate, "dp_replicate");
  dim(d.shard, "dp_shard");
  if (d.cp > 1) dim(d.cp, "cp");
  if (d.tp > 1) dim(d.tp, "tp");
  return d;
}

MeshPtr make_mesh(const ParallelismOptions& options, const std::string& device_type) {
  const MeshDims d = mesh_dims(options, dist::world_size());
  return init_device_mesh(device_type, d.shape, d.names);
}

void parallelize(nn::LanguageModel& model, const MeshPtr& mesh, const ParallelismOptions& o) {
  // Tensor parallelism first, over the innermost dim; FSDP over the data
  // dims (a pipeline's stages each hold their own parameters: not "pp").
  const auto& names = mesh->dim_names();
  if (names.back() == "tp")
    tp::parallelize_module(model, (*mesh)["tp"],
                           tp::tensor_parallel_plan(model, mesh->size(-1), o.loss_parallel, o.sequence_parallel));
  const bool context = std::find(names.begin(), names.end(), "cp") != names.end();
  if (context) {
    TS_CHECK(o.cp_rotate_method != "ring" || mesh->device_type() != "cuda",
             "cp_rotate_method ring passes K/V as point-to-point messages, which the NCCL process groups do not "
             "have yet: use allgather on CUDA");
    cp::apply_context_parallel(model, mesh->get_group("cp"),
                               {.rotate_method = cp::parse_rotate_method(o.cp_rotate_method),
                                .load_balance = o.cp_load_balance,
                                .names = [](const char* field) {
                                  const std::string f = field;
                                  return f == "load_balance" ? std::string("cp_load_balance")
                                         : f == "seq_len"    ? std::string("the sequence length")
                                                             : f;
                                }});
  }
  // The data dims; the context-parallel ranks hold one model replica's
  // gradients of different tokens, so FSDP shards over data x context.
  std::vector<std::string> data;
  for (const std::string& n : names)
    if (n != "tp" && n != "pp" && n != "cp") data.push_back(n);
  if (context) {
    const MeshPtr top = mesh->root();
    top->slice({"dp_shard", "cp"})->flatten("dp_shard_cp");
    data.back() = "dp_shard_cp";
  }
  const MeshPtr dp = context ? mesh->root()->slice(data) : data.size() == names.size() ? mesh : mesh->slice(data);
  const bool pipelined = std::find(names.begin(), names.end(), "pp") != names.end();
  const std::vector<nn::MoE*> moes = nn::moe_layers(model);
  TS_CHECK(moes.empty() || (!pipelined && !context),
           "a mixture of experts composes with FSDP, HSDP, tensor and expert parallelism so far; under pipeline or "
           "context parallelism it is not written yet (mesh {})", mesh->str());
  MeshPtr experts_dp;  // the mesh the experts' FSDP shards over (expert parallelism)
  if (!moes.empty()) {
    // Every data rank's tokens are one batch: the balance statistics sum over them.
    const dist::ProcessGroupPtr batch = dp->size() > 1 ? dp->flat_group() : nullptr;
    if (o.ep > 1) {
      // TorchTitan's carving: the same ranks with dp_shard split into
      // (dp_shard_mod_ep, ep); the experts shard over ep and are FSDP'd over
      // the rest of the data dims. Under tensor parallelism the experts are
      // whole on every tensor-parallel rank (tp/parallelize.h), each of which
      // exchanges its copy of the tokens with the ranks of its own tp index.
      const int64_t shard = mesh->size(mesh->dim_index("dp_shard"));  // ep divides it (mesh_dims)
      const MeshPtr expert_mesh = mesh->unflatten("dp_shard", {shard / o.ep, o.ep}, {"dp_shard_mod_ep", "ep"});
      std::vector<std::string> dims = expert_mesh->dim_names();
      ep::apply_expert_parallel(model, (*expert_mesh)["ep"], batch, "moe_experts", "ep");
      std::erase_if(dims, [](const std::string& n) { return n == "ep" || n == "tp"; });
      experts_dp = expert_mesh->slice(dims);
    } else {
      for (nn::MoE* m : moes) m->batch_group = batch;
    }
  }
  fsdp::FullyShardOptions opt{
      .mesh = dp,
      // true keeps PyTorch's default (the root stays unsharded after forward: it is needed first in backward)
      .reshard_after_forward =
          pipelined ? fsdp::ReshardAfterForward{false}  // gathered across the micro-batches
          : o.reshard_after_forward_degree > 0
              ? fsdp::ReshardAfterForward{static_cast<int>(o.reshard_after_forward_degree)}
          : o.reshard_after_forward ? fsdp::ReshardAfterForward{}
                                    : fsdp::ReshardAfterForward{false},
      .mp_policy = {.param_dtype = o.param_dtype, .reduce_dtype = o.reduce_dtype},
      .offload_policy = o.cpu_offload ? std::make_shared<fsdp::CPUOffloadPolicy>() : nullptr};
  for (auto& block : model.blocks) {
    if (experts_dp) {
      // The experts first, over the ranks that hold the same ones; every data
      // rank's tokens reached them, so their gradients divide by all of them.
      fsdp::FullyShardOptions expert_opt = opt;
      expert_opt.mesh = experts_dp;
      for (nn::MoE* m : nn::moe_layers(*block)) {
        fsdp::fully_shard(*m->experts, expert_opt);
        fsdp::set_gradient_divide_factor(*m->experts, static_cast<double>(dp->size()));
      }
    }
    fsdp::fully_shard(*block, opt);
  }
  fsdp::fully_shard(model, opt);
  if (!o.prefetch) fsdp::set_prefetch(model, false);
}

std::shared_ptr<pp::Pipeline> make_pipeline(const nn::TransformerConfig& cfg, const MeshPtr& mesh,
                                            const ParallelismOptions& o, uint64_t seed) {
  const auto& names = mesh->dim_names();
  TS_CHECK(std::find(names.begin(), names.end(), "pp") != names.end(),
           "make_pipeline: the mesh has no pp dim (ParallelismOptions::pp is {})", o.pp);
  pp::PipelineOptions po{.schedule = o.pp_schedule,
                         .microbatches = static_cast<int>(o.pp_microbatches > 0 ? o.pp_microbatches : 2 * o.pp),
                         .stages_per_rank = static_cast<int>(
                             o.pp_stages_per_rank > 0 ? o.pp_stages_per_rank : o.pp_schedule == "interleaved_1f1b" ? 2 : 1),
                         .layers_per_stage = o.pp_layers_per_stage,
                         .module_names_per_stage = o.pp_module_names_per_stage,
                         .activation_dtype = o.param_dtype};
  // Sequence parallelism: the residual stream between blocks, and so between
  // stages, is split on the sequence over the tensor-parallel ranks.
  if (o.sequence_parallel && names.back() == "tp") {
    po.activation_mesh = (*mesh)["tp"];
    po.activation_placements = {Shard{1}};
  }
  auto pipe = std::make_shared<pp::Pipeline>(mesh->get_group("pp"), cfg, po);
  for (const auto& [s, part] : pipe->parts()) parallelize(*part, mesh, o);
  // Context parallelism: this rank's stages hold the same slice of each
  // sequence, one shard object for all (Pipeline::step shards each micro-batch once).
  if (std::find(names.begin(), names.end(), "cp") != names.end()) {
    const std::shared_ptr<nn::SequenceShard> slices = pipe->parts().begin()->second->sequence_shard();
    for (const auto& [s, part] : pipe->parts()) part->set_sequence_shard(slices);
  }
  pipe->materialize(mesh->device(), seed);
  return pipe;
}

}  // namespace tessera::train
