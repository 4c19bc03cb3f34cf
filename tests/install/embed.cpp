// A program an engine would write against the *installed* Tessera: built by
// tests/install/check_install.sh with the flags from `pkg-config tessera`.
#include <tessera/tessera.h>

#include <cstdio>

using namespace tessera;

int main() {
  nn::Linear layer(3, 2);
  layer.init_weights(1);
  optim::SGD opt(layer.parameters(), {.lr = 0.1});
  Tensor x = randn({8, 3}, 2), y = randn({8, 2}, 3);
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    Tensor diff = layer(x) - y;
    Tensor loss = mean(diff * diff);
    if (step == 0) first = loss.item();
    last = loss.item();
    autograd::backward(loss);
    opt.step();
    opt.zero_grad();
  }
  std::printf("installed tessera: loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}
