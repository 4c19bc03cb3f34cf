// The output layer and loss in chunks (linear_cross_entropy, and
// LanguageModel::loss on it) against the unchunked pair, cross_entropy of
// linear: loss and both gradients in f64 to 1e-12 and f32 to 1e-5 at awkward
// sizes and chunkings (one row, a prime, the whole batch), ignored targets
// (a chunk of nothing but them too), a scaled upstream gradient; bf16
// against f32 within bf16's bounds; the peak memory of a step falling by the
// logits' size.
#include <cmath>

#include "autograd/functions.h"
#include "autograd/tape.h"
#include "nn/models.h"
#include "runtime/allocator.h"
#include "tests/helpers.h"

using namespace tessera;

namespace {

// max |a - b| / max(1, max |b|), in f64.
double rel_err(const Tensor& a, const Tensor& b) {
  auto va = ops::to(a, DType::F64).to_vector<double>(), vb = ops::to(b, DType::F64).to_vector<double>();
  REQUIRE(va.size() == vb.size());
  double scale = 1, err = 0;
  for (double x : vb) scale = std::max(scale, std::fabs(x));
  for (size_t i = 0; i < va.size(); ++i) err = std::max(err, std::fabs(va[i] - vb[i]));
  return err / scale;
}

struct Result {
  Tensor loss, dx, dw;
};

// Loss and gradients of (x, w, t), chunked (chunk_rows) or not (-1), the loss scaled by `upstream`.
Result run(const Tensor& x0, const Tensor& w0, const Tensor& t, int64_t chunk_rows, double upstream = 1.0) {
  Tensor x = ops::clone(x0), w = ops::clone(w0);
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  Tensor loss = chunk_rows < 0 ? cross_entropy(reshape(linear(x, w), {t.numel(), w.size(0)}), reshape(t, {t.numel()}))
                               : linear_cross_entropy(x, w, t, chunk_rows);
  autograd::backward(mul(loss, upstream));
  return {loss, x.grad(), w.grad()};
}

}  // namespace

TEST_CASE("linear_cross_entropy: the unchunked loss and gradients, f64 and f32, any chunking", "[loss][chunked]") {
  const int64_t B = 3, T = 37, C = 19, V = 101;
  for (DType dt : {DType::F64, DType::F32}) {
    const double tol = dt == DType::F64 ? 1e-12 : 1e-5;
    Tensor x = ops::to(randn({B, T, C}, 1, DType::F64), dt), w = ops::to(ops::mul(randn({V, C}, 2, DType::F64), 0.3), dt);
    std::vector<int64_t> ids = randint({B * T}, 0, V, 3).to_vector<int64_t>();
    for (int64_t i = 0; i < B * T; i += 5) ids[static_cast<size_t>(i)] = -100;  // ignored targets
    for (int64_t i = 40; i < 47; ++i) ids[static_cast<size_t>(i)] = -100;        // a chunk of 7 of nothing else
    Tensor t = from_vector(ids, {B, T});
    for (double upstream : {1.0, 0.25}) {
      Result ref = run(x, w, t, -1, upstream);
      for (int64_t chunk : {int64_t{1}, int64_t{7}, int64_t{13}, B * T, int64_t{0}, int64_t{1000}}) {
        INFO(dtype_name(dt) << " chunk " << chunk << " upstream " << upstream);
        Result got = run(x, w, t, chunk, upstream);
        CHECK(got.loss.dtype() == dt);
        CHECK(got.dx.shape() == x.shape());
        CHECK(rel_err(got.loss, ref.loss) <= tol);
        CHECK(rel_err(got.dx, ref.dx) <= tol);
        CHECK(rel_err(got.dw, ref.dw) <= tol);
      }
    }
    // Every target ignored: a loss of 0 and zero gradients, as unchunked.
    Tensor none = full({B, T}, -100.0, DType::I64);
    Result all_ignored = run(x, w, none, 10);
    CHECK(all_ignored.loss.item() == 0.0);
    CHECK(ops::sum_squares(all_ignored.dw) == 0.0);
  }
}

TEST_CASE("linear_cross_entropy: bf16 follows the f32 loss within bf16's bounds", "[loss][chunked]") {
  const int64_t N = 129, C = 24, V = 257;
  Tensor x = ops::to(randn({N, C}, 4, DType::F32), DType::BF16);
  Tensor w = ops::to(ops::mul(randn({V, C}, 5, DType::F32), 0.2), DType::BF16);
  Tensor t = randint({N}, 0, V, 6);
  // The reference: f32 on the same (bf16-rounded) values.
  Result ref = run(ops::to(x, DType::F32), ops::to(w, DType::F32), t, -1);
  Result got = run(x, w, t, 32);
  CHECK(got.dw.dtype() == DType::BF16);
  CHECK(rel_err(got.loss, ref.loss) <= 1e-2);
  CHECK(rel_err(got.dx, ref.dx) <= 2e-2);
  CHECK(rel_err(got.dw, ref.dw) <= 2e-2);
}

TEST_CASE("linear_cross_entropy: no gradient wanted, nothing recorded; bad shapes refused", "[loss][chunked]") {
  Tensor x = randn({10, 4}, 7), w = randn({9, 4}, 8), t = randint({10}, 0, 9, 9);
  Tensor l = linear_cross_entropy(x, w, t, 3);
  CHECK_FALSE(l.requires_grad());
  CHECK(std::fabs(l.item() - cross_entropy(linear(x, w), t).item()) < 1e-6);
  CHECK_THROWS_WITH(linear_cross_entropy(x, randn({9, 5}, 8), t, 3), Catch::Contains("do not chain"));
  CHECK_THROWS_WITH(linear_cross_entropy(x, w, randint({11}, 0, 9, 9), 3), Catch::Contains("11 targets for 10 rows"));
  CHECK_THROWS_WITH(linear_cross_entropy(x, ops::to(w, DType::F64), t, 3), Catch::Contains("x is f32"));
}

namespace {
nn::TransformerConfig model_config(bool llama) {
  nn::TransformerConfig cfg;
  cfg.vocab_size = 211;
  cfg.block_size = 16;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 16;
  if (llama) cfg.n_kv_head = 1;
  return cfg;
}

// The loss and every gradient of model.loss at `chunk_rows` (< 0: unchunked).
template <class Model>
std::vector<Tensor> model_loss(bool llama, int64_t chunk_rows) {
  auto model = std::make_shared<Model>(model_config(llama));
  model->to(DType::F64);
  model->set_loss_chunk_rows(chunk_rows);
  Tensor x = randint({3, 11}, 0, 211, 10), y = randint({3, 11}, 0, 211, 11);
  Tensor loss = model->loss(x, y);
  autograd::backward(loss);
  std::vector<Tensor> out{loss};
  for (auto& [name, p] : model->named_parameters()) out.push_back(p.grad());
  return out;
}
}  // namespace

TEST_CASE("LanguageModel::loss: chunked equals unchunked for GPT-2 (tied) and Llama in f64", "[loss][chunked][model]") {
  for (bool llama : {false, true}) {
    INFO((llama ? "llama" : "gpt2"));
    auto ref = llama ? model_loss<nn::Llama>(true, -1) : model_loss<nn::GPT>(false, -1);
    for (int64_t chunk : {int64_t{4}, int64_t{0}}) {
      auto got = llama ? model_loss<nn::Llama>(true, chunk) : model_loss<nn::GPT>(false, chunk);
      REQUIRE(got.size() == ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        INFO("chunk " << chunk << " tensor " << i);
        CHECK(rel_err(got[i], ref[i]) <= 1e-12);
      }
    }
  }
  // Without the output layer there is no loss to take.
  auto model = std::make_shared<nn::GPT>(model_config(false));
  CHECK(model->chunk_rows_for(int64_t{1} << 30) == (int64_t{256} << 20) / (211 * 4));
  CHECK(model->chunk_rows_for(1000) == 1000);
  model->set_loss_chunk_rows(64);
  CHECK(model->chunk_rows_for(10) == 10);
  CHECK(model->chunk_rows_for(1000) == 64);
}

TEST_CASE("the chunked loss keeps the logits from ever being whole: the peak falls by their size", "[loss][chunked][memory]") {
  // 1024 rows of a 6000-token vocabulary: 24 MiB of f32 logits, and as much for their gradient.
  const int64_t N = 1024, C = 32, V = 6000;
  const int64_t logits_bytes = N * V * 4;
  Tensor x = randn({N, C}, 12), w = ops::mul(randn({V, C}, 13), 0.1), t = randint({N}, 0, V, 14);
  auto peak_of = [&](int64_t chunk) {
    Tensor xx = ops::clone(x), ww = ops::clone(w);
    xx.set_requires_grad(true);
    ww.set_requires_grad(true);
    reset_peak_memory_stats(Device::cpu());
    const int64_t base = memory_stats(Device::cpu()).allocated_bytes;
    Tensor loss = chunk < 0 ? cross_entropy(linear(xx, ww), t) : linear_cross_entropy(xx, ww, t, chunk);
    autograd::backward(loss);
    return memory_stats(Device::cpu()).peak_allocated_bytes - base;
  };
  const int64_t whole = peak_of(-1), chunked = peak_of(64);
  INFO("peak above the inputs: unchunked " << whole << " bytes, chunked " << chunked << ", logits " << logits_bytes);
  CHECK(whole - chunked >= logits_bytes);
  CHECK(chunked < logits_bytes / 4);
}
