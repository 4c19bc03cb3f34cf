// Checkpoints of a pipelined run (fsdp/checkpoint.h, pp/pipeline.h), under
// mpirun with 2 and 4 ranks: a PP 2 x FSDP run's checkpoint holds every
// tensor of the model and its optimizer once, under the full model's names;
// it loads bit for bit as one process (a whole model on every rank), as FSDP
// over every rank and, at four ranks, as TP 2 x FSDP 2; a run resumed from
// it on its own layout takes the same steps as the run that saved it; and the
// pipelined model exports to one .safetensors file and imports from it.

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <map>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "pp/pipeline.h"
#include "tests/helpers.h"
#include "train/parallelize.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

// A scratch folder every rank sees, removed at the end.
struct ScratchDir {
  fs::path path;
  ScratchDir() {
    std::string mine;
    if (dist::rank() == 0) {
      char tmpl[] = "/tmp/tessera-pp-ckpt-XXXXXX";
      REQUIRE(mkdtemp(tmpl) != nullptr);
      mine = tmpl;
    }
    path = dist::all_gather_strings(dist::world(), mine)[0];
  }
  ~ScratchDir() {
    dist::world()->barrier()->wait();
    if (dist::rank() == 0) fs::remove_all(path);
  }
};

nn::TransformerConfig config() {
  nn::TransformerConfig c;
  c.arch = "llama";
  c.vocab_size = 23;
  c.block_size = 6;
  c.n_layer = 5;  // stages of 3 and 2 blocks
  c.n_head = 2;
  c.n_kv_head = 2;  // whole key/value heads per rank at tensor parallel 2
  c.n_embd = 12;
  c.tie_embeddings = false;
  c.dropout = 0;
  return c;
}

std::pair<Tensor, Tensor> batch(int step, int64_t rows) {
  return {randint({rows, 6}, 0, 23, 500 + 2 * static_cast<uint64_t>(step)),
          randint({rows, 6}, 0, 23, 501 + 2 * static_cast<uint64_t>(step))};
}

optim::AdamWOptions adamw() {
  return {.lr = 3e-2, .weight_decay = 0.1};
}

// A pipelined run: PP 2 x FSDP over the other ranks, 4 micro-batches per step.
struct PipelinedRun {
  train::ParallelismOptions options{.pp = 2, .pp_microbatches = 4};
  MeshPtr mesh = train::make_mesh(options);
  std::shared_ptr<pp::Pipeline> pipe = train::make_pipeline(config(), mesh, options, 7);
  pp::PipelinedModel model{pipe};
  optim::AdamW opt{model.parameters(), adamw()};

  // One step on this data-parallel rank's rows of the global batch; the loss
  // averaged over the data-parallel ranks.
  double step(int k) {
    auto dp = mesh->get_group("dp_shard");
    const int64_t rows = 8;  // per data-parallel rank: 4 micro-batches of 2
    auto [idx, targets] = batch(k, rows * dp->size());
    Tensor loss = pipe->step(ops::contiguous(ops::narrow(idx, 0, dp->rank() * rows, rows)),
                             ops::contiguous(ops::narrow(targets, 0, dp->rank() * rows, rows)));
    dp->all_reduce(loss, {.op = dist::ReduceOp::Avg})->wait();
    pipe->clip_grad_norm_(0.5);
    opt.step();
    opt.zero_grad();
    return loss.item();
  }
};

// Every tensor a checkpoint of (model, opt) holds, whole, by name.
std::map<std::string, Tensor> whole_state(nn::Module& model, optim::AdamW& opt) {
  std::map<std::string, Tensor> out;
  auto whole = [](const Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; };
  for (auto& [name, t] : model.state_dict()) out[name] = whole(t);
  for (auto& [name, t] : opt.state_dict(model.named_parameters())) out["optim." + name] = whole(t);
  return out;
}

// Bit for bit.
void check_same(const std::map<std::string, Tensor>& got, const std::map<std::string, Tensor>& want) {
  for (const auto& [name, t] : got) {
    INFO(name);
    REQUIRE(want.count(name) == 1);
    REQUIRE(t.shape() == want.at(name).shape());
    CHECK(testing::max_abs_diff(ops::to(t, DType::F64), ops::to(want.at(name), DType::F64)) == 0);
  }
}

}  // namespace

TEST_CASE("a PP x FSDP checkpoint loads on any layout and resumes bit for bit", "[pp][checkpoint]") {
  dist::init();
  const int W = dist::world_size();
  if (W % 2 != 0) return;  // PP 2 x FSDP 1 at two ranks, 2 x 2 at four
  ScratchDir dir;
  PipelinedRun run;
  run.step(0);
  run.step(1);
  const std::string saved_dir = fsdp::save_checkpoint(dir.path, 2, run.model, &run.opt);

  // What the checkpoint holds, each tensor assembled from its chunks: every
  // parameter of the whole model once, under its own name, with its moments.
  const fsdp::CheckpointMetadata md = fsdp::read_metadata(saved_dir);
  std::map<std::string, Tensor> saved;
  for (const auto& t : md.tensors) saved[t.name] = fsdp::read_full_tensor(saved_dir, t);
  auto whole_model = nn::make_model(config(), Device::meta());
  size_t params = 0;
  for (auto& [name, t] : whole_model->named_parameters()) {
    INFO(name);
    CHECK(saved.count(name) == 1);
    CHECK(saved.count("optim." + name + ".exp_avg") == 1);
    ++params;
  }
  CHECK(saved.size() == params + 3 * params);  // weights; exp_avg, exp_avg_sq and step of each
  check_same(whole_state(run.model, run.opt), saved);  // this rank's stages, as saved

  // Loaded into a model laid out by `layout` (nothing: whole), its weights and moments bit for bit.
  auto loads = [&](const std::function<void(nn::LanguageModel&)>& layout) {
    auto model = nn::make_model(config(), Device::meta());
    layout(*model);
    model->to_empty(Device::cpu());
    optim::AdamW opt(model->parameters(), adamw());
    fsdp::load_checkpoint(saved_dir, *model, &opt);
    const auto got = whole_state(*model, opt);
    CHECK(got.size() == saved.size());
    check_same(got, saved);
  };
  SECTION("as one process: a whole model on every rank") {
    loads([](nn::LanguageModel&) {});
  }
  SECTION("as FSDP over every rank, and as TP 2 x FSDP 2") {
    for (int64_t tp : {1, 2}) {
      if (tp == 2 && W != 4) continue;
      INFO("tp " << tp);
      train::ParallelismOptions o{.tp = tp};
      MeshPtr mesh = train::make_mesh(o);
      loads([&](nn::LanguageModel& model) { train::parallelize(model, mesh, o); });
    }
  }
  SECTION("exported to one .safetensors file and imported, whole and pipelined") {
    const std::string file = (dir.path / "model.safetensors").string();
    fsdp::save_safetensors(run.model, file);  // rank 0 writes; stage 1's tensors come from its ranks
    auto model = nn::make_model(config(), Device::meta());
    model->to_empty(Device::cpu());
    fsdp::load_safetensors(*model, file);
    std::map<std::string, Tensor> got;
    for (auto& [name, t] : model->state_dict()) got[name] = t;
    CHECK(got.size() == params);
    check_same(got, saved);
    PipelinedRun imported;
    fsdp::load_safetensors(imported.model, file);
    std::map<std::string, Tensor> mine;
    for (auto& [name, t] : imported.model.state_dict()) mine[name] = is_dtensor(t) ? full_tensor(t) : t;
    check_same(mine, saved);
  }
  SECTION("resumed on its own layout, the next steps are the same") {
    std::vector<double> want = {run.step(2), run.step(3)};
    PipelinedRun resumed;
    const auto md2 = fsdp::load_checkpoint(saved_dir, resumed.model, &resumed.opt);
    CHECK(md2.step == 2);
    std::vector<double> got = {resumed.step(2), resumed.step(3)};
    CHECK(got == want);
    check_same(whole_state(resumed.model, resumed.opt), whole_state(run.model, run.opt));
  }
}

TEST_CASE("a pipelined model refuses a checkpoint that holds tensors no stage has", "[pp][checkpoint][errors]") {
  dist::init();
  if (dist::world_size() % 2 != 0) return;
  ScratchDir dir;
  // Saved from a model of six blocks; the pipeline's has five: "layers.5" is on no stage.
  auto bigger = config();
  bigger.n_layer = 6;
  auto six = nn::make_model(bigger, Device::meta());
  six->to_empty(Device::cpu());
  six->init_weights(3);
  const std::string saved_dir = fsdp::save_checkpoint(dir.path, 1, *six, nullptr);
  PipelinedRun run;
  CHECK_THROWS_WITH(fsdp::load_checkpoint(saved_dir, run.model, nullptr),
                    Catch::Contains("unexpected keys ['model.layers.5."));
}
