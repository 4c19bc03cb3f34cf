// An engine's training program against the *installed* Tessera
// (tests/install/check_install.sh builds it with pkg-config and CMake, shared
// and static): a Hugging Face GPT-2 folder and its tokenizer.json, the model
// sharded with FSDP over the job's ranks, three training steps on a text
// file, and a checkpoint. Rank 0 prints each step's loss for the script to
// compare with tessera-train's on the same data and seed.
//
//   mpirun -np 2 train_hf HF_FOLDER TEXT_FILE WORK_FOLDER
#include <tessera/tessera.h>

#include <cstdio>
#include <string>

using namespace tessera;

int main(int argc, char** argv) {
  dist::init(argc, argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: train_hf HF_FOLDER TEXT_FILE WORK_FOLDER\n");
    return 2;
  }
  const std::string hf = argv[1], text = argv[2], work = argv[3];
  try {
    // The model and its tokenizer, as transformers saved them.
    const nn::TransformerConfig cfg = io::read_hf_config(hf);
    const io::BpeTokenizer tokenizer = io::BpeTokenizer::load(hf + "/tokenizer.json");
    auto [train_tokens, val_tokens] = io::text_dataset({text}, work + "/data", "text", &tokenizer);

    // FSDP over every rank: built on meta, sharded, then each rank's shards
    // filled from the file.
    const train::ParallelismOptions parallel;
    MeshPtr mesh = train::make_mesh(parallel);
    auto model = nn::make_model(cfg, Device::meta());
    train::parallelize(*model, mesh, parallel);
    model->to_empty(Device::cpu());
    fsdp::load_full_state_dict(*model, io::read_hf_weights(hf, cfg));

    // tessera-train's defaults: AdamW, warmup then cosine, batch 8, seed 1234.
    const int64_t steps = 3, batch = 8;
    optim::AdamW* adamw = nullptr;
    auto optimizer = train::make_optimizer(*model, {}, &adamw);
    const optim::LRSchedule schedule = train::make_schedule({}, train::OptimizerOptions{}.lr, steps);
    const io::Loader loader(std::move(train_tokens), cfg.block_size, 1234);
    const int rank = dist::rank(), world = dist::world_size();
    for (int64_t step = 0; step < steps; ++step) {
      train::StepResult r = train::train_step(
          *model, *optimizer, schedule.lr_at(step), {},
          [&](int64_t) { return loader.batch(step, batch / world, rank, world); }, dist::world());
      const double loss = r.loss.item();
      if (rank == 0) std::printf("step %lld loss %.17g\n", static_cast<long long>(step + 1), loss);
    }
    const std::string dir = fsdp::save_checkpoint(work + "/checkpoint", steps, *model, adamw);
    if (rank == 0) std::printf("checkpoint %s\n", dir.c_str());
  } catch (const std::exception& e) {
    dist::abort(std::string("train_hf: ") + e.what());
  }
  dist::finalize();
  return 0;
}
