// The smallest useful Tessera program: build a GPT, train it a few steps on
// random tokens, print the loss. Built with the project (build/examples/).
#include <tessera/tessera.h>

#include <cstdio>

using namespace tessera;

int main() {
  nn::TransformerConfig cfg{.vocab_size = 256, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 64};
  auto model = nn::GPT::on_meta(cfg);  // shapes only, no memory yet
  model->to_empty(Device::cpu());
  model->init_weights(/*seed=*/1234);  // values depend only on (seed, parameter name)
  optim::AdamW optimizer(model->parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  Tensor x = randint({4, 64}, 0, 256, 1), y = randint({4, 64}, 0, 256, 2);
  for (int step = 0; step < 10; ++step) {
    Tensor loss = nn::cross_entropy((*model)(x), y);  // model(x), not model.forward(x)
    autograd::backward(loss);
    nn::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    optimizer.zero_grad();
    std::printf("step %d loss %.4f\n", step, loss.item());
  }
}
