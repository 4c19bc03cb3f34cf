// Selective activation checkpointing against none and full: GPT-2 and Llama
// in f64 and f32, the loss and every gradient bit for bit whichever blocks
// are checkpointed and whatever they keep (the recomputation runs the same
// ops, or takes back the products' outputs it would compute); the peak
// memory ordered none > selective > full; a recomputation that runs other
// ops than the first run is refused by name.
#include "autograd/functions.h"
#include "autograd/tape.h"
#include "nn/models.h"
#include "runtime/allocator.h"
#include "tests/helpers.h"

using namespace tessera;

namespace {

struct Ac {
  const char* name;
  bool on;
  int64_t every;
  bool save_matmuls;
};
const Ac kModes[] = {{"none", false, 1, false},
                     {"full", true, 1, false},
                     {"selective op", true, 1, true},
                     {"selective every 2", true, 2, false},
                     {"selective every 2, op", true, 2, true}};

nn::TransformerConfig config(bool llama, const Ac& ac) {
  nn::TransformerConfig cfg;
  cfg.vocab_size = 97;
  cfg.block_size = 32;
  cfg.n_layer = 3;
  cfg.n_head = 4;
  cfg.n_embd = 24;
  cfg.dropout = llama ? 0.0 : 0.1;  // GPT: dropout masks must replay too
  if (llama) cfg.n_kv_head = 2;
  cfg.activation_checkpoint = ac.on;
  cfg.ac_layer_frequency = ac.every;
  cfg.ac_save_matmuls = ac.save_matmuls;
  return cfg;
}

template <class Model>
std::vector<Tensor> step(bool llama, const Ac& ac, DType dt, int64_t* peak = nullptr) {
  auto model = std::make_shared<Model>(config(llama, ac));
  model->to(dt);
  manual_seed(5);
  Tensor x = randint({2, 19}, 0, 97, 1), y = randint({2, 19}, 0, 97, 2);
  reset_peak_memory_stats(Device::cpu());
  const int64_t base = memory_stats(Device::cpu()).allocated_bytes;
  Tensor loss = nn::cross_entropy((*model)(x), y);
  autograd::backward(loss);
  if (peak) *peak = memory_stats(Device::cpu()).peak_allocated_bytes - base;
  std::vector<Tensor> out{loss};
  for (auto& [name, p] : model->named_parameters()) out.push_back(p.grad());
  return out;
}

bool bitwise(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!testing::equal(a[i], b[i])) return false;
  return true;
}

}  // namespace

TEST_CASE("selective activation checkpointing: the loss and gradients of no checkpointing, bit for bit", "[checkpoint][selective]") {
  for (bool llama : {false, true})
    for (DType dt : {DType::F64, DType::F32}) {
      auto ref = llama ? step<nn::Llama>(true, kModes[0], dt) : step<nn::GPT>(false, kModes[0], dt);
      for (const Ac& ac : kModes) {
        INFO((llama ? "llama " : "gpt2 ") << dtype_name(dt) << " " << ac.name);
        auto got = llama ? step<nn::Llama>(true, ac, dt) : step<nn::GPT>(false, ac, dt);
        CHECK(bitwise(got, ref));
      }
    }
}

TEST_CASE("selective activation checkpointing: which blocks, and the peak between none and full", "[checkpoint][selective][memory]") {
  auto cfg = config(false, kModes[3]);
  CHECK(cfg.checkpoints_layer(0));
  CHECK_FALSE(cfg.checkpoints_layer(1));
  CHECK(cfg.checkpoints_layer(2));
  nn::GPT every2(cfg);
  CHECK(static_cast<nn::GPTBlock&>(*every2.blocks[0]).checkpoint);
  CHECK_FALSE(static_cast<nn::GPTBlock&>(*every2.blocks[1]).checkpoint);
  nn::Llama every2l(config(true, kModes[3]));
  CHECK_FALSE(static_cast<nn::LlamaBlock&>(*every2l.blocks[1]).checkpoint);
  int64_t none = 0, full = 0, op = 0, two = 0;
  step<nn::GPT>(false, kModes[0], DType::F32, &none);
  step<nn::GPT>(false, kModes[1], DType::F32, &full);
  step<nn::GPT>(false, kModes[2], DType::F32, &op);
  step<nn::GPT>(false, kModes[3], DType::F32, &two);
  INFO("peak above the inputs: none " << none << ", full " << full << ", selective op " << op << ", every 2 " << two);
  CHECK(full < op);
  CHECK(op < none);
  CHECK(full < two);
  CHECK(two < none);
  auto bad = config(false, kModes[0]);
  bad.ac_layer_frequency = 0;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("ac_layer_frequency must be >= 1"));
}

TEST_CASE("selective checkpointing refuses a recomputation that runs more products than the first run", "[checkpoint][selective]") {
  Tensor w = randn({5, 5}, 3);
  w.set_requires_grad(true);
  int runs = 0;
  Tensor x = randn({2, 5}, 4);
  Tensor y = autograd::checkpoint(
      [&](const TensorList& in) {
        Tensor h = linear(in[0], w);
        if (++runs > 1) h = linear(h, w);  // a different segment the second time
        return TensorList{h};
      },
      {x}, {.save_matmuls = true})[0];
  CHECK_THROWS_WITH(autograd::backward(sum(y)), Catch::Contains("ran more products than the first run kept"));
  autograd::clear_tape();
}
