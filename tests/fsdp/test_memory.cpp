// Peak memory per rank (allocator stats) within the bounds of PyTorch's
// test_fully_shard_memory.py, adapted to Tessera's buffers; and sharded state
// shrinking as 1/W.
#include "runtime/allocator.h"
#include "tests/fsdp/fsdp_helpers.h"

using namespace tessera;
using namespace tessera::testing;

namespace {
nn::TransformerConfig big_blocks() {
  // Parameters dominate: 3 blocks of ~0.8M parameters each, a tiny batch.
  nn::TransformerConfig t;
  t.vocab_size = 32;
  t.block_size = 16;
  t.n_layer = 3;
  t.n_head = 4;
  t.n_embd = 256;
  return t;
}

int64_t bytes_now() { return memory_stats().allocated_bytes; }
}  // namespace

TEST_CASE("peak memory stays within the FSDP bounds", "[fsdp][memory]") {
  int w = world();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  auto cfg = big_blocks();
  // Activation memory of this batch, measured on the unsharded model: the slack
  // every bound below allows on top of parameter memory.
  int64_t activations = 0;
  {
    nn::GPT plain(cfg);
    int64_t start = bytes_now();
    reset_peak_memory_stats();
    Tensor loss = nn::cross_entropy(plain(randint({2, 16}, 0, 32, 0)), randint({2, 16}, 0, 32, 1));
    activations = memory_stats().peak_allocated_bytes - start;
    autograd::clear_tape();
  }
  for (bool raf : {true, false}) {
    INFO("reshard_after_forward " << raf);
    int64_t base = bytes_now();
    auto model = nn::GPT::on_meta(cfg);
    int64_t U = model->num_parameters(false), B = 0;
    for (auto& [n, p] : model->blocks[0]->named_parameters()) B += p.numel();
    int64_t N = U - 3 * B;
    for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = mesh, .reshard_after_forward = raf});
    fsdp::fully_shard(*model, {.mesh = mesh, .reshard_after_forward = raf});
    model->to_empty(Device::cpu());
    model->init_weights(1);
    // Init: only the shards (plus padding) live.
    int64_t sharded = bytes_now() - base;
    double S = static_cast<double>(U) / w;
    CHECK(sharded <= static_cast<int64_t>((S + B) * 4));
    CHECK(static_cast<double>(sharded) <= S * 4 * 1.05 + 4096);  // ~1/W of the model per rank
    const int64_t slack = activations + (256 << 10);  // activations, plus small buffers
    optim::AdamW opt(model->parameters(), {.lr = 1e-3});
    for (int it = 0; it < 2; ++it) {
      Tensor x = randint({2, 16}, 0, 32, it), y = randint({2, 16}, 0, 32, it + 1);
      int64_t start = bytes_now();
      reset_peak_memory_stats();
      Tensor loss = nn::cross_entropy((*model)(x), y);
      int64_t fwd = memory_stats().peak_allocated_bytes - start;
      // RAF true: the current block, the prefetched next block and its flat buffer,
      // and the root's parameters (PyTorch: (3B + N) * 4). RAF false: everything unsharded.
      if (raf) CHECK(fwd <= (3 * B + N) * 4 + slack);
      else CHECK(fwd <= (U + B) * 4 + slack);
      reset_peak_memory_stats();
      autograd::backward(loss);
      int64_t bwd = memory_stats().peak_allocated_bytes - start;
      // Gathered blocks, unsharded gradients of one block and the reduce buffers,
      // and the sharded gradients: PyTorch's (4B + N) * 4 + 2S * 4 (RAF true).
      if (raf) CHECK(bwd <= (4 * B + N) * 4 + static_cast<int64_t>(2 * S * 4) + slack);
      else CHECK(bwd <= (U + 2 * B) * 4 + static_cast<int64_t>(2 * S * 4) + slack);
      opt.step();
      // Parameters, gradients and two Adam moments, all sharded: 4S.
      CHECK(bytes_now() - base <= static_cast<int64_t>(4 * S * 4 * 1.05) + slack);
      opt.zero_grad();
      CHECK(bytes_now() - base <= static_cast<int64_t>(3 * S * 4 * 1.05) + slack);
    }
  }
}
