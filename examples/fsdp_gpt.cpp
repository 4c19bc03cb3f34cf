// FSDP2 in a page: shard a GPT over every rank and train it on random tokens.
//   mpirun -np 4 --oversubscribe build/examples/fsdp_gpt
#include <tessera/tessera.h>

#include <cstdio>

using namespace tessera;

int main(int argc, char** argv) {
  dist::init(argc, argv);                                     // MPI; world size 1 without mpirun
  auto mesh = init_device_mesh("cpu", {dist::world_size()}, {"dp"});
  nn::TransformerConfig cfg{.vocab_size = 256, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 64};
  auto model = nn::GPT::on_meta(cfg);                         // no memory yet
  fsdp::FullyShardOptions opt{.mesh = mesh};
  for (auto& block : model->blocks) fsdp::fully_shard(*block, opt);  // bottom-up: blocks,
  fsdp::fully_shard(*model, opt);                                    // then the root
  model->to_empty(Device::cpu());                             // bytes for the local shards only
  model->init_weights(/*seed=*/1234);                         // the same values at any world size
  optim::AdamW optimizer(model->parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  for (int step = 0; step < 5; ++step) {
    // Each rank trains on its own part of the global batch.
    Tensor x = randint({2, 64}, 0, 256, 100 * step + dist::rank());
    Tensor y = randint({2, 64}, 0, 256, 100 * step + dist::rank() + 50);
    Tensor loss = nn::cross_entropy((*model)(x), y);          // model(x), not model.forward(x)
    autograd::backward(loss);                                 // reduce-scatters gradients per block
    nn::clip_grad_norm_(model->parameters(), 1.0);            // one all-reduce of the squared norm
    optimizer.step();                                         // on the local shards, no communication
    optimizer.zero_grad();
    if (dist::rank() == 0) std::printf("step %d loss %.4f (rank 0's batch)\n", step, loss.item());
  }
}
