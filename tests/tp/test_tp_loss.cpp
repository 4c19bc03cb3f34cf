// Loss parallelism in chunks (nn::LanguageModel::loss on a tensor-parallel
// output layer) under mpirun with 1-4 ranks: the same loss and gradients as
// the logits whole, and one chunk's logits shard held at a time.
#include "runtime/allocator.h"
#include "tests/tp/tp_helpers.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// The loss and every gradient (whole) of LanguageModel::loss on a
// loss-parallel model at `chunk_rows` (< 0: the logits whole).
std::vector<Tensor> loss_parallel_grads(bool gpt, bool sequence_parallel, int64_t chunk_rows, const Tensor& x,
                                        const Tensor& y) {
  MeshPtr mesh = tp_mesh();
  nn::TransformerConfig c = tp_test_config();
  c.tie_embeddings = gpt;  // GPT-2's output layer is its embedding table, split over the vocabulary
  std::shared_ptr<nn::LanguageModel> model;
  if (gpt) model = tp_model<nn::GPT>(c, mesh, 9, true, sequence_parallel);
  else model = tp_model<nn::Llama>(c, mesh, 9, true, sequence_parallel);
  model->set_loss_chunk_rows(chunk_rows);
  Tensor loss = model->loss(x, y);
  autograd::backward(loss);
  std::vector<Tensor> out{ops::reshape(ops::to(loss, DType::F64), {1})};
  for (auto& [name, p] : model->named_parameters()) out.push_back(whole(p.grad()));
  return out;
}

}  // namespace

TEST_CASE("loss parallelism in chunks: the output layer and loss by slices equal the whole, in f64",
          "[tp][loss][chunked]") {
  const bool gpt = GENERATE(false, true), sp = GENERATE(false, true);
  INFO((gpt ? "gpt2 (tied)" : "llama") << (sp ? ", sequence parallel" : ""));
  Tensor x = randint({4, 7}, 0, 19, 71), y = randint({4, 7}, 0, 19, 72);
  // Some ignored targets: each chunk's mean is weighed by its counted ones.
  y = ops::where(ops::binary(ops::BinaryOp::Eq, randint({4, 7}, 0, 4, 73), 0.0), full({}, -100.0, DType::I64), y);
  const auto ref = loss_parallel_grads(gpt, sp, -1, x, y);
  // 5 rows: slices of one position (or, where the positions are split, one
  // sequence); 9: of two positions; 1000: one chunk (the unchunked path).
  for (int64_t chunk : {int64_t{5}, int64_t{9}, int64_t{1000}}) {
    const auto got = loss_parallel_grads(gpt, sp, chunk, x, y);
    REQUIRE(got.size() == ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("chunk rows " << chunk << ", tensor " << i);
      CHECK_CLOSE(got[i], ref[i], 1e-12, 1e-15);
    }
  }
}

TEST_CASE("loss parallelism in chunks holds one chunk's logits shard: the peak falls by their size",
          "[tp][loss][chunked][memory]") {
  MeshPtr mesh = tp_mesh();
  nn::TransformerConfig c = tp_test_config();
  c.vocab_size = 4001;  // 2001+2000, 1334+1334+1333, 1001+1000+1000+1000 columns a rank
  c.block_size = 64;
  auto peak_of = [&](int64_t chunk_rows) {
    auto model = tp_model<nn::Llama>(c, mesh, 4, true, false);
    model->set_loss_chunk_rows(chunk_rows);
    Tensor x = randint({4, 64}, 0, c.vocab_size, 81), y = randint({4, 64}, 0, c.vocab_size, 82);
    reset_peak_memory_stats(Device::cpu());
    const int64_t base = memory_stats(Device::cpu()).allocated_bytes;
    autograd::backward(model->loss(x, y));
    return memory_stats(Device::cpu()).peak_allocated_bytes - base;
  };
  const int64_t columns = (c.vocab_size + world() - 1) / world();
  const int64_t shard_bytes = 4 * 64 * columns * 8;  // this rank's f64 logits
  const int64_t unchunked = peak_of(-1), chunked = peak_of(32);
  INFO("peak above the inputs: unchunked " << unchunked << " bytes, chunked " << chunked << ", logits shard "
                                           << shard_bytes);
  CHECK(unchunked - chunked >= shard_bytes);
}
