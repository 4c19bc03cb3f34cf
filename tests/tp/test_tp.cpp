// Tensor parallelism (tp/parallelize.h) under mpirun with 1-4 ranks, the
// tensor-parallel degree being the world size: every rank sees the whole
// batch, and the split model must give the single process's outputs,
// gradients and AdamW steps (f64), with Megatron's count of collectives.
#include <filesystem>

#include "fsdp/checkpoint.h"
#include "tests/tp/tp_helpers.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

nn::TransformerConfig llama_config(int w) {
  nn::TransformerConfig c = tp_test_config();
  c.n_kv_head = w == 4 ? 4 : 6;  // GQA, whole key/value heads on every rank
  c.bias = false;
  return c;
}

std::shared_ptr<nn::Llama> tp_llama(const nn::TransformerConfig& c, const MeshPtr& mesh, uint64_t seed,
                                    bool loss_parallel = false, bool sequence_parallel = false) {
  return tp_model<nn::Llama>(c, mesh, seed, loss_parallel, sequence_parallel);
}

void train_step(nn::Module& model, optim::AdamW& opt, uint64_t seed, int64_t vocab) {
  Tensor x = randint({3, 7}, 0, vocab, seed), y = randint({3, 7}, 0, vocab, seed + 1);
  autograd::backward(nn::cross_entropy(model(x), y));
  opt.step();
  opt.zero_grad();
}

}  // namespace

TEST_CASE("a column-wise then a row-wise Linear give the unsplit MLP's values and gradients", "[tp]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  // 13 hidden features split torch.chunk-wise: 7+6, 5+5+3, 4+4+4+1.
  MLP ref(7, 13, 5);
  ref.init_weights(3);
  ref.to(DType::F64);
  auto model = std::make_shared<MLP>(7, 13, 5, Device::meta());
  tp::parallelize_module(*model, mesh, {{"fc1", tp::style(tp::ColwiseParallel{})},
                                        {"fc2", tp::style(tp::RowwiseParallel{})}});
  CHECK(dtensor_spec(model->fc1->weight).placements == Placements{Shard{0}});
  CHECK(dtensor_spec(model->fc2->weight).placements == Placements{Shard{1}});
  CHECK(dtensor_spec(model->fc2->bias).placements == Placements{Replicate{}});
  model->to_empty(Device::cpu());
  model->init_weights(3);  // each shard draws its own elements of the full init
  model->to(DType::F64);
  check_parity(*model, ref, 0, false);

  Tensor x0 = randn({4, 3, 7}, 11, DType::F64), probe = randn({4, 3, 5}, 12, DType::F64);
  Tensor xr = ops::clone(x0), xt = ops::clone(x0);
  xr.set_requires_grad(true);
  xt.set_requires_grad(true);
  Tensor yr = ref(xr);
  autograd::backward(sum(yr * probe));

  mesh->get_group(0)->reset_stats();
  Tensor yt = (*model)(xt);
  CHECK_FALSE(is_dtensor(yt));  // use_local_output: the model sees a plain tensor
  // Forward: the row-wise output's Partial -> Replicate, one all-reduce (none
  // on one rank, where nothing is split).
  const int64_t one = w > 1 ? 1 : 0;
  CHECK(stats(mesh).all_reduce == one);
  autograd::backward(sum(yt * probe));
  // Backward: the column-wise input's gradient, Partial -> Replicate.
  const auto s = stats(mesh);
  CHECK(s.all_reduce == 2 * one);
  CHECK(s.all_gather + s.reduce_scatter + s.broadcast + s.all_to_all == 0);
  CHECK(s.mpi_calls == s.all_reduce);
  CHECK_CLOSE(yt, yr, 1e-12, 1e-14);
  CHECK_CLOSE(xt.grad(), xr.grad(), 1e-12, 1e-14);
  check_parity(*model, ref, 1e-12, true);
}

TEST_CASE("Llama with tensor parallelism follows one process over AdamW steps, with Megatron's collectives",
          "[tp][parity]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  nn::TransformerConfig c = llama_config(w);
  // Loss parallelism: the output layer column-wise over the 19-token
  // vocabulary (10+9, 7+6+6, 5+5+5+4), its logits never gathered. The
  // embedding table is split over the vocabulary too; an output layer tied
  // to it is split as it is, with or without loss parallelism.
  const bool loss_parallel = GENERATE(false, true);
  c.tie_embeddings = GENERATE(false, true);
  INFO("loss parallel " << loss_parallel << ", tied " << c.tie_embeddings);
  nn::Llama ref(c);
  ref.init_weights(5);
  ref.to(DType::F64);
  auto model = tp_llama(c, mesh, 5, loss_parallel);
  const bool head_split = loss_parallel || c.tie_embeddings;
  CHECK(is_dtensor(model->lm_head->weight) == head_split);
  CHECK(dtensor_spec(model->embed_tokens->weight).placements == Placements{Shard{0}});
  CHECK(model->lm_head->weight.is_same(model->embed_tokens->weight) == c.tie_embeddings);
  for (const char* p : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"}) {
    INFO(p);  // this rank's share of the heads or features
    Tensor t = *nn::find_in(model->state_dict(), p);
    auto [shape, offset] = local_shape_and_offset(t.shape(), *mesh, dtensor_spec(t).placements, mesh->get_coordinate());
    CHECK(local_tensor(t).shape() == shape);
    CHECK((w == 1) == (shape_numel(shape) == t.numel()));
  }
  check_parity(*model, ref, 0, false);

  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref.parameters(), o), topt(model->parameters(), o);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({3, 7}, 0, c.vocab_size, 40 + step), y = randint({3, 7}, 0, c.vocab_size, 50 + step);
    Tensor rloss = nn::cross_entropy(ref(x), y);
    autograd::backward(rloss);
    mesh->get_group(0)->reset_stats();
    Tensor tloss = nn::cross_entropy((*model)(x), y);
    const int64_t on = w > 1 ? 1 : 0, per_layer = on * 2 * c.n_layer;
    // The loss: the row maximum, the sum of exponentials, the target logit.
    const int64_t loss = on * (loss_parallel ? 3 : 0), head_input = on * (head_split ? 1 : 0);
    // Attention's and the MLP's outputs, the embedding's rows; a tied output
    // layer without loss parallelism gathers its logits.
    const int64_t gathered = on * (c.tie_embeddings && !loss_parallel ? 1 : 0);
    CHECK(stats(mesh).all_reduce == per_layer + on + loss);
    CHECK(stats(mesh).all_gather == gathered);
    CHECK_FALSE(is_dtensor(tloss));
    autograd::backward(tloss);
    const auto s = stats(mesh);
    CHECK(s.all_reduce == 2 * per_layer + on + loss + head_input);  // and their inputs' gradients
    CHECK(s.all_gather == gathered);
    CHECK(s.reduce_scatter + s.broadcast + s.all_to_all == 0);
    CHECK(s.mpi_calls == s.all_reduce + s.all_gather);
    CHECK(tloss.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, ref, topt, ropt);
  }
  check_parity(*model, ref, 1e-10, false);
}

TEST_CASE("Llama with sequence parallelism follows one process, gathering and scattering tokens", "[tp][sp]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  nn::TransformerConfig c = llama_config(w);
  // 7 tokens split torch.chunk-wise: 4+3, 3+3+1, 2+2+2+1.
  const bool loss_parallel = GENERATE(false, true);
  c.tie_embeddings = GENERATE(false, true);
  INFO("loss parallel " << loss_parallel << ", tied " << c.tie_embeddings);
  const bool head_split = loss_parallel || c.tie_embeddings;
  nn::Llama ref(c);
  ref.init_weights(6);
  ref.to(DType::F64);
  auto model = tp_llama(c, mesh, 6, loss_parallel, /*sequence_parallel=*/true);
  const Tensor norm = *nn::find_in(model->state_dict(), "model.layers.1.post_attention_layernorm.weight");
  CHECK(dtensor_spec(norm).placements == Placements{Replicate{}});
  check_parity(*model, ref, 0, false);

  // The residual stream is this rank's tokens, a Shard(1) DTensor.
  Tensor seen;
  model->submodule("model.layers.0").register_forward_hook(
      [&](nn::Module&, const TensorList&, TensorList& out) { seen = out[0]; });
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref.parameters(), o), topt(model->parameters(), o);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({3, 7}, 0, c.vocab_size, 140 + step), y = randint({3, 7}, 0, c.vocab_size, 150 + step);
    Tensor rloss = nn::cross_entropy(ref(x), y);
    autograd::backward(rloss);
    mesh->get_group(0)->reset_stats();
    Tensor tloss = nn::cross_entropy((*model)(x), y);
    REQUIRE(is_dtensor(seen));
    CHECK(dtensor_spec(seen).placements == Placements{Shard{1}});
    CHECK(local_tensor(seen).size(1) ==
          local_shape_and_offset({3, 7, c.n_embd}, *mesh, {Shard{1}}, mesh->get_coordinate()).first[1]);
    // Forward, per block: attention's and the MLP's inputs all-gathered, their
    // outputs reduce-scattered; the embedding's rows reduce-scattered to the
    // sequence split; the output layer gathers the last norm's tokens (and a
    // tied one without loss parallelism its logits).
    const int64_t on = w > 1 ? 1 : 0, L = c.n_layer;
    auto f = stats(mesh);
    CHECK(f.all_gather == on * (2 * L + 1 + (c.tie_embeddings && !loss_parallel ? 1 : 0)));
    CHECK(f.reduce_scatter == on * (2 * L + 1));
    CHECK(f.all_reduce == on * (loss_parallel ? 3 : 0));  // the vocabulary-parallel loss's
    autograd::backward(tloss);
    // Backward mirrors it (a gather's gradient is scattered, and the other way),
    // and each norm's weight gradient, a sum over this rank's tokens, is
    // all-reduced once.
    auto b = stats(mesh);
    CHECK(b.all_gather - f.all_gather == on * (2 * L + 1));
    CHECK(b.reduce_scatter - f.reduce_scatter == on * (2 * L + (head_split ? 1 : 0)));
    CHECK(b.all_reduce - f.all_reduce == on * (2 * L + 1));
    CHECK(b.broadcast + b.all_to_all == 0);
    CHECK(dtensor_spec(model->norm->weight.grad()).placements == Placements{Replicate{}});
    CHECK(tloss.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, ref, topt, ropt);
  }
  check_parity(*model, ref, 1e-10, false);

  // Activation checkpointing recomputes the blocks, gathers and scatters included.
  nn::TransformerConfig ac = c;
  ac.activation_checkpoint = true;
  auto recomputed = tp_llama(ac, mesh, 6, loss_parallel, true);
  nn::Llama fresh(c);
  fresh.init_weights(6);
  fresh.to(DType::F64);
  Tensor x = randint({3, 7}, 0, c.vocab_size, 160), y = randint({3, 7}, 0, c.vocab_size, 161);
  autograd::backward(nn::cross_entropy(fresh(x), y));
  autograd::backward(nn::cross_entropy((*recomputed)(x), y));
  check_parity(*recomputed, fresh, 1e-10, true);
}

TEST_CASE("norms on sequence-split DTensors: rows normalised where they lie, weight gradients summed", "[tp][sp]") {
  MeshPtr mesh = tp_mesh();
  Tensor x0 = randn({3, 7, 6}, 21, DType::F64), probe = randn({3, 7, 6}, 22, DType::F64);
  for (bool rms : {false, true}) {
    for (int64_t dim : {0, 1}) {
      INFO((rms ? "rms_norm" : "layer_norm") << " on Shard(" << dim << ")");
      std::shared_ptr<nn::Module> ref, split;
      if (rms) ref = std::make_shared<nn::RMSNorm>(6), split = std::make_shared<nn::RMSNorm>(6);
      else ref = std::make_shared<nn::LayerNorm>(6), split = std::make_shared<nn::LayerNorm>(6);
      for (auto* m : {ref.get(), split.get()}) {
        m->to(DType::F64);
        for (auto& [name, p] : m->named_parameters()) {  // not the 1s and 0s a norm starts from
          autograd::NoGradGuard no_grad;
          ops::copy_(p, randn(p.shape(), name == "weight" ? 23 : 24, DType::F64));
        }
      }
      tp::parallelize_module(*split, mesh, {{"", tp::style(tp::SequenceParallel{.sequence_dim = dim})}});
      Tensor xr = ops::clone(x0);
      xr.set_requires_grad(true);
      autograd::backward(sum((*ref)(xr) * probe));
      auto mine = [&](const Tensor& t) { return ops::clone(local_tensor(distribute_tensor(t, mesh, {Shard{dim}}))); };
      Tensor xt = mine(x0);  // this rank's rows
      xt.set_requires_grad(true);
      Tensor in = from_local(xt, mesh, {Shard{dim}}, x0.shape());
      Tensor out = (*split)(in);
      REQUIRE(is_dtensor(out));
      CHECK(dtensor_spec(out).placements == Placements{Shard{dim}});
      mesh->get_group(0)->reset_stats();
      // Each rank's loss over its own rows: their sum is the reference's.
      autograd::backward(sum(to_local(out) * mine(probe)));
      CHECK_CLOSE(full_tensor(out), (*ref)(x0), 1e-13, 1e-13);
      CHECK_CLOSE(xt.grad(), mine(xr.grad()), 1e-12, 1e-13);
      check_parity(*split, *ref, 1e-12, true);
      // One all-reduce per parameter's gradient, where the rows are split.
      CHECK(stats(mesh).all_reduce == (world() > 1 ? static_cast<int64_t>(split->parameters().size()) : 0));
    }
  }
}

TEST_CASE("embedding tables split over the vocabulary or the features give the whole table's rows", "[tp]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  // 11 tokens: 6+5, 4+4+3, 3+3+3+2 rows; 5 features: 3+2, 2+2+1, 2+2+1+0.
  Tensor table = randn({11, 5}, 31, DType::F64), ids = randint({3, 4}, 0, 11, 32);
  Tensor probe = randn({3, 4, 5}, 33, DType::F64);
  Tensor ref = ops::clone(table);
  ref.set_requires_grad(true);
  autograd::backward(sum(embedding(ref, ids) * probe));
  struct Case {
    Placement table, out;
  };
  for (const Case& k : {Case{Shard{0}, Partial{}}, Case{Shard{1}, Shard{2}}, Case{Replicate{}, Replicate{}}}) {
    INFO("table " << placement_str(k.table));
    Tensor t = distribute_tensor(table, mesh, {k.table});
    t.set_requires_grad(true);
    mesh->get_group(0)->reset_stats();
    Tensor out = embedding(t, ids);
    CHECK(stats(mesh).total() == 0);  // the lookup itself moves nothing
    CHECK(dtensor_spec(out).placements == normalize_placements({k.out}, *mesh, 3, "test"));
    Tensor whole_out = full_tensor(out);
    CHECK_CLOSE(whole_out, embedding(table, ids), 0, 0);
    // Backward from a Replicate gradient, laid out as the table.
    autograd::backward(sum(to_local(redistribute(out, {Replicate{}})) * probe));
    CHECK(dtensor_spec(t.grad()).placements == Placements{k.table});
    CHECK_CLOSE(whole(t.grad()), ref.grad(), 1e-14, 1e-14);
  }
  // Indices split on the batch over a replicated table: rows split the same way.
  Tensor rows = distribute_tensor(ids, mesh, {Shard{0}});
  Tensor out = embedding(distribute_tensor(table, mesh, {Replicate{}}), rows);
  CHECK(dtensor_spec(out).placements == Placements{Shard{0}});
  CHECK_CLOSE(full_tensor(out), embedding(table, ids), 0, 0);
  // A token no rank holds is refused on every rank, as the whole table's kernel refuses it.
  Tensor bad = ops::clone(ids);
  ops::fill_(ops::narrow(ops::reshape(bad, {12}), 0, 7, 1), 11.0);
  if (w > 1) {
    CHECK_THROWS_WITH(embedding(distribute_tensor(table, mesh, {Shard{0}}), bad),
                      Catch::Contains("embedding: 1 index(es) out of range for a table of 11 rows (expected 0..10)"));
    CHECK_THROWS_WITH(embedding(distribute_tensor(table, mesh, {Shard{0}}), rows),
                      Catch::Contains("the table is split (S(0)) on mesh dim 0, so every rank there needs every index"));
  }
}

TEST_CASE("tensor-parallel plans and styles refuse what they cannot split, naming it", "[tp][errors]") {
  MeshPtr mesh = tp_mesh();
  nn::TransformerConfig c;
  c.vocab_size = 11;
  c.block_size = 4;
  c.n_layer = 1;
  c.n_head = 6;
  c.n_kv_head = 3;
  c.n_embd = 12;
  auto llama = nn::Llama::on_meta(c);
  CHECK_THROWS_WITH(tp::tensor_parallel_plan(*llama, 4), Catch::Contains("model.n_head 6 is not divisible by the degree 4"));
  CHECK_THROWS_WITH(tp::tensor_parallel_plan(*llama, 2), Catch::Contains("model.n_kv_head 3 is not divisible by the degree 2"));
  c.n_kv_head = 0;
  CHECK_THROWS_WITH(tp::tensor_parallel_plan(*nn::GPT::on_meta(c), 4), Catch::Contains("model.n_head 6 is not divisible by the degree 4"));
  CHECK_THROWS_WITH(tp::style(tp::ColwiseParallel{.blocks = 0}), Catch::Contains("blocks must be at least 1, got 0"));
  {  // A tied output layer and table must be laid out alike.
    nn::TransformerConfig tied = llama_config(2);
    tied.tie_embeddings = true;
    CHECK_THROWS_WITH(tp::parallelize_module(*nn::Llama::on_meta(tied), mesh,
                                             {{"model.embed_tokens", tp::style(tp::RowwiseParallel{})}}),
                      Catch::Contains("'model.embed_tokens.weight' and 'lm_head.weight' are one parameter (tied), but "
                                      "the plan lays out the first as (S(0)) and leaves the second as it was"));
    CHECK_THROWS_WITH(tp::parallelize_module(*nn::Llama::on_meta(tied), mesh,
                                             {{"model.embed_tokens", tp::style(tp::RowwiseParallel{})},
                                              {"lm_head", tp::style(tp::RowwiseParallel{})}}),
                      Catch::Contains("are one parameter (tied), but the plan lays them out as (S(0)) and (S(1))"));
  }
  CHECK_THROWS_WITH(tp::parallelize_module(*llama, mesh, {{"model.layers.*.mlp", tp::style(tp::ColwiseParallel{})}}),
                    Catch::Contains("ColwiseParallel applies to Linear and Embedding layers, but 'model.layers.0.mlp' is a LlamaMLP"));
  CHECK_THROWS_WITH(tp::parallelize_module(*llama, mesh, {{"model.layers.*.mlp.fc9", tp::style(tp::RowwiseParallel{})}}),
                    Catch::Contains("'model.layers.*.mlp.fc9' (RowwiseParallel) matches no module"));
  CHECK_THROWS_WITH(tp::parallelize_module(*llama, init_device_mesh("cpu", {1, world()}, {"dp", "tp"}), {}),
                    Catch::Contains("expected a 1-D mesh"));
  // Twice on one layer: its weight is already a DTensor.
  tp::parallelize_module(*llama, mesh, {{"model.layers.0.mlp.up_proj", tp::style(tp::ColwiseParallel{})}});
  CHECK_THROWS_WITH(tp::parallelize_module(*llama, mesh, {{"model.layers.0.mlp.up_proj", tp::style(tp::ColwiseParallel{})}}),
                    Catch::Contains("already a DTensor"));
  CHECK_THROWS_WITH(tp::parallelize_module(*llama, mesh, {{"model.layers.0.mlp.down_proj", tp::style(tp::SequenceParallel{})}}),
                    Catch::Contains("SequenceParallel applies to LayerNorm and RMSNorm, but 'model.layers.0.mlp.down_proj' is a Linear"));
  // A norm on a DTensor needs a Replicate DTensor weight and whole rows.
  {
    nn::RMSNorm norm(6);
    Tensor x = distribute_tensor(randn({2, 5, 6}, 3), mesh, {Shard{1}});
    CHECK_THROWS_WITH(norm(x), Catch::Contains("the weight is a plain tensor; make it a Replicate DTensor"));
    tp::parallelize_module(norm, mesh, {{"", tp::style(tp::SequenceParallel{})}});
    if (world() > 1)
      CHECK_THROWS_WITH(norm(distribute_tensor(randn({2, 5, 6}, 3), mesh, {Shard{2}})),
                        Catch::Contains("is split on the normalised (last) dim"));
  }
  // A linear whose operands' placements have no rule names the op and the placements.
  Tensor a = distribute_tensor(randn({4, 6}, 1), mesh, {Shard{0}});
  Tensor b = distribute_tensor(randn({5, 6}, 2), mesh, {Shard{1}});
  if (world() > 1) CHECK_THROWS_WITH(ops::linear(a, b), Catch::Contains("linear: no sharding rule for input S(0) and weight S(1)"));
}

TEST_CASE("a tensor-parallel checkpoint reloads as one process, as FSDP and as tensor-parallel", "[tp][checkpoint]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  const nn::TransformerConfig c = llama_config(w);
  SharedDir dir;
  const bool sp = GENERATE(false, true);  // sequence parallelism: norms' weights Replicate DTensors
  INFO("sequence parallel " << sp);
  auto model = tp_llama(c, mesh, 5, false, sp);
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW opt(model->parameters(), o);
  train_step(*model, opt, 60, c.vocab_size);
  fsdp::save_checkpoint(dir.path.string(), 1, *model, &opt);

  // One process (every rank reads every chunk), FSDP over the same ranks, and
  // tensor parallelism again: the same values, bit for bit, and the same
  // AdamW moments (the next step agrees within rounding).
  nn::Llama plain(c);
  plain.to(DType::F64);
  optim::AdamW plain_opt(plain.parameters(), o);
  fsdp::load_checkpoint(fsdp::latest_checkpoint(dir.path.string()), plain, &plain_opt);
  auto sharded = nn::Llama::on_meta(c);
  MeshPtr dp = init_device_mesh("cpu", {w}, {"dp"});
  for (auto& b : sharded->blocks) fsdp::fully_shard(*b, {.mesh = dp});
  fsdp::fully_shard(*sharded, {.mesh = dp});
  sharded->to_empty(Device::cpu());
  sharded->to(DType::F64);
  optim::AdamW sharded_opt(sharded->parameters(), o);
  fsdp::load_checkpoint(fsdp::latest_checkpoint(dir.path.string()), *sharded, &sharded_opt);
  auto again = tp_llama(c, mesh, 99, false, sp);
  optim::AdamW again_opt(again->parameters(), o);
  fsdp::load_checkpoint(fsdp::latest_checkpoint(dir.path.string()), *again, &again_opt);
  auto want = model->named_parameters();
  for (nn::Module* loaded : {static_cast<nn::Module*>(&plain), static_cast<nn::Module*>(sharded.get()),
                             static_cast<nn::Module*>(again.get())}) {
    auto got = loaded->named_parameters();
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(loaded->type_name() << " " << got[i].first);
      CHECK(equal(whole(got[i].second), whole(want[i].second)));
    }
  }
  train_step(*model, opt, 70, c.vocab_size);
  train_step(plain, plain_opt, 70, c.vocab_size);
  train_step(*again, again_opt, 70, c.vocab_size);
  check_parity(plain, *model, 1e-10, false);
  check_parity(*again, *model, 0, false);
}

namespace {
// FSDP over tensor parallelism on a (dp, tp) mesh ((replicate, shard, tp) for
// HSDP): every block and the root fully_shard over the data-parallel dims of
// a Llama that parallelize_module split over tp.
void run_fsdp_tp_parity(const Shape& shape, const std::vector<std::string>& names, bool sequence_parallel) {
  INFO("mesh " << shape_str(shape) << (sequence_parallel ? ", sequence parallel" : ""));
  MeshPtr mesh = init_device_mesh("cpu", shape, names);
  const int64_t tp = mesh->size(-1), dp = mesh->size() / tp;
  std::vector<std::string> dp_names(names.begin(), names.end() - 1);
  MeshPtr dp_mesh = mesh->slice(dp_names);
  nn::TransformerConfig c = llama_config(static_cast<int>(tp));
  nn::Llama ref(c);
  ref.init_weights(5);
  ref.to(DType::F64);
  auto model = fsdp_tp_model<nn::Llama>(c, mesh, dp_names, 5, sequence_parallel);
  // A column-wise weight: tensor-parallel rows, FSDP's chunk of them inside.
  const Tensor q = *nn::find_in(model->state_dict(), "model.layers.0.self_attn.q_proj.weight");
  CHECK(dtensor_spec(q).mesh->dim_names().front() == "tp");
  CHECK(dtensor_spec(q).placements.front() == Placement{Shard{0}});
  CHECK(dtensor_spec(q).placements.back() == Placement{Shard{0}});
  check_parity(*model, ref, 0, false);

  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref.parameters(), o), topt(model->parameters(), o);
  // Each data-parallel rank takes its rows of the global batch; the ranks of
  // one tensor-parallel group take the same rows.
  const int64_t rows = 2, global_rows = rows * dp;
  const int64_t dp_rank = dp_rank_of(mesh);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({global_rows, 7}, 0, c.vocab_size, 80 + step);
    Tensor y = randint({global_rows, 7}, 0, c.vocab_size, 90 + step);
    Tensor rloss = nn::cross_entropy(ref(x), y);
    autograd::backward(rloss);
    Tensor tloss = nn::cross_entropy((*model)(ops::narrow(x, 0, dp_rank * rows, rows)),
                                     ops::narrow(y, 0, dp_rank * rows, rows));
    autograd::backward(tloss);
    Tensor mean = ops::reshape(ops::clone(detach(tloss)), {1});
    dp_mesh->flat_group()->all_reduce(mean, {dist::ReduceOp::Avg})->wait();
    CHECK(mean.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, ref, topt, ropt);
  }
  check_parity(*model, ref, 1e-10, false);
}
}  // namespace

TEST_CASE("FSDP over tensor parallelism (2-D) and HSDP over it (3-D) follow one process", "[tp][fsdp][parity]") {
  const int w = world();
  for (int tp : {1, 2, 3, 4}) {
    if (w % tp != 0 || (tp == 4 && w != 4)) continue;
    run_fsdp_tp_parity({w / tp, tp}, {"dp", "tp"}, false);
  }
  if (w == 4) run_fsdp_tp_parity({2, 1, 2}, {"replicate", "shard", "tp"}, false);
  // With sequence parallelism: the norms' Replicate weights sharded by FSDP
  // over dp, their gradients all-reduced over tp as they accumulate.
  if (w > 1) run_fsdp_tp_parity({w / (w == 4 ? 2 : w), w == 4 ? 2 : w}, {"dp", "tp"}, true);
  if (w == 4) run_fsdp_tp_parity({2, 1, 2}, {"replicate", "shard", "tp"}, true);
}

namespace {
std::shared_ptr<nn::Llama> fsdp_llama(const nn::TransformerConfig& c, const MeshPtr& mesh, uint64_t seed) {
  return fsdp_tp_model<nn::Llama>(c, mesh, {"dp"}, seed);
}
}  // namespace

TEST_CASE("checkpoints move between FSDP, FSDP x TP and one process", "[tp][fsdp][checkpoint]") {
  const int w = world();
  const int64_t tp = w == 4 ? 2 : w;
  const nn::TransformerConfig c = llama_config(static_cast<int>(tp));
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  // FSDP over all ranks (tensor parallelism of degree 1), one step, saved.
  MeshPtr flat = init_device_mesh("cpu", {w, 1}, {"dp", "tp"});
  auto fsdp_only = fsdp_llama(c, flat, 5);
  optim::AdamW fsdp_opt(fsdp_only->parameters(), o);
  train_rows(*fsdp_only, fsdp_opt, 100, flat->get_local_rank(0), w, c.vocab_size);
  SharedDir a, b;
  fsdp::save_checkpoint(a.path.string(), 1, *fsdp_only, &fsdp_opt);
  // Loaded at dp x tp: the same values, and the same moments (the next steps agree).
  MeshPtr mesh = init_device_mesh("cpu", {w / tp, tp}, {"dp", "tp"});
  auto two_d = fsdp_llama(c, mesh, 77);
  optim::AdamW two_d_opt(two_d->parameters(), o);
  fsdp::load_checkpoint(fsdp::latest_checkpoint(a.path.string()), *two_d, &two_d_opt);
  check_equal_params(*two_d, *fsdp_only);
  train_rows(*fsdp_only, fsdp_opt, 110, flat->get_local_rank(0), w, c.vocab_size);
  train_rows(*two_d, two_d_opt, 110, mesh->get_local_rank(0), w / tp, c.vocab_size);
  check_parity(*two_d, *fsdp_only, 1e-10, false);
  // Saved at dp x tp: every element written exactly once (a shard that the
  // tensor-parallel ranks share, by one of them), and read back by one process.
  fsdp::save_checkpoint(b.path.string(), 2, *two_d, &two_d_opt);
  const std::string dir = fsdp::latest_checkpoint(b.path.string());
  check_chunks_tile(dir);
  nn::Llama plain(c);
  plain.to(DType::F64);
  optim::AdamW plain_opt(plain.parameters(), o);
  fsdp::load_checkpoint(dir, plain, &plain_opt);
  check_equal_params(plain, *two_d);
}

TEST_CASE("FSDP over tensor parallelism in bf16: gathered as bf16 DTensors, training as FSDP alone does",
          "[tp][fsdp][mixed_precision]") {
  const int w = world();
  const int64_t tp = w == 4 ? 2 : w;
  const nn::TransformerConfig c = llama_config(static_cast<int>(tp));
  fsdp::MixedPrecisionPolicy mp{.param_dtype = DType::BF16, .reduce_dtype = DType::F32};
  auto build = [&](const MeshPtr& mesh) {
    auto model = nn::Llama::on_meta(c);
    tp::parallelize_module(*model, (*mesh)["tp"], tp::tensor_parallel_plan(*model, mesh->size(1)));
    for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = (*mesh)["dp"], .mp_policy = mp});
    fsdp::fully_shard(*model, {.mesh = (*mesh)["dp"], .mp_policy = mp});
    model->to_empty(Device::cpu());
    model->init_weights(5);
    return model;
  };
  MeshPtr flat = init_device_mesh("cpu", {w, 1}, {"dp", "tp"}), mesh = init_device_mesh("cpu", {w / tp, tp}, {"dp", "tp"});
  auto alone = build(flat), two_d = build(mesh);
  // In forward a column-wise weight is this rank's bf16 rows, as a tensor-parallel DTensor.
  nn::Module& q_proj = two_d->submodule("model.layers.0.self_attn.q_proj");
  bool seen = false;
  q_proj.register_forward_pre_hook([&](nn::Module& m, TensorList&) {
    const Tensor& weight = m.find_parameter_slot("weight")->value;
    CHECK(weight.dtype() == DType::BF16);
    CHECK(dtensor_spec(weight).mesh->dim_names() == std::vector<std::string>{"tp"});
    CHECK(local_tensor(weight).size(0) * tp >= c.n_embd);
    seen = true;
  });
  // SGD: Adam would turn bf16 noise in near-zero gradients into full-size steps.
  optim::SGDOptions o{.lr = 0.1, .momentum = 0.9};
  optim::SGD opt_alone(alone->parameters(), o), opt_two_d(two_d->parameters(), o);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({12, 7}, 0, c.vocab_size, 120 + step), y = randint({12, 7}, 0, c.vocab_size, 130 + step);
    auto loss_of = [&](nn::Module& model, const MeshPtr& m, optim::SGD& opt) {
      const int64_t dp = m->size(0), rows = 12 / dp, r = m->get_local_rank(0);
      Tensor loss = nn::cross_entropy(model(ops::narrow(x, 0, r * rows, rows)), ops::narrow(y, 0, r * rows, rows));
      autograd::backward(loss);
      opt.step();
      opt.zero_grad();
      Tensor mean = ops::reshape(ops::to(detach(loss), DType::F64), {1});
      (*m)["dp"]->get_group(0)->all_reduce(mean, {dist::ReduceOp::Avg})->wait();
      return mean.item();
    };
    const double a = loss_of(*alone, flat, opt_alone), b = loss_of(*two_d, mesh, opt_two_d);
    CHECK(b == Approx(a).epsilon(2e-2));  // bf16 products in another order
  }
  CHECK(seen);
  auto pa = alone->named_parameters(), pb = two_d->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(whole(pb[i].second).dtype() == DType::F32);  // the sharded parameters stay f32
    CHECK_CLOSE(whole(pb[i].second), whole(pa[i].second), 2e-2, 1e-3);
  }
}

TEST_CASE("activation checkpointing recomputes tensor-parallel blocks, all-reduces included", "[tp][checkpointing]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  nn::TransformerConfig c = llama_config(w);
  nn::Llama ref(c);
  ref.init_weights(5);
  ref.to(DType::F64);
  c.activation_checkpoint = true;
  auto model = tp_llama(c, mesh, 5);
  Tensor x = randint({3, 7}, 0, c.vocab_size, 140), y = randint({3, 7}, 0, c.vocab_size, 141);
  Tensor rloss = nn::cross_entropy(ref(x), y);
  autograd::backward(rloss);
  mesh->get_group(0)->reset_stats();
  Tensor tloss = nn::cross_entropy((*model)(x), y);
  autograd::backward(tloss);
  // Forward 2 per block and the embedding's; backward recomputes the blocks'
  // (2 more) before its own 2.
  CHECK(stats(mesh).all_reduce == (w > 1 ? 6 * c.n_layer + 1 : 0));
  CHECK(tloss.item() == Approx(rloss.item()).epsilon(1e-12));
  check_parity(*model, ref, 1e-10, true);

  // Selective, per op: the products' outputs (DTensors) kept, the rest recomputed.
  c.ac_save_matmuls = true;
  auto selective = tp_llama(c, mesh, 5);
  Tensor sloss = nn::cross_entropy((*selective)(x), y);
  autograd::backward(sloss);
  CHECK(sloss.item() == Approx(rloss.item()).epsilon(1e-12));
  check_parity(*selective, ref, 1e-10, true);
}

TEST_CASE("a column-wise layer may hand on its DTensor: elementwise ops follow its placements, both ways",
          "[tp]") {
  MeshPtr mesh = tp_mesh();
  MLP ref(7, 13, 5);
  ref.init_weights(3);
  ref.to(DType::F64);
  auto model = std::make_shared<MLP>(7, 13, 5, Device::meta());
  tp::parallelize_module(*model, mesh, {{"fc1", tp::style(tp::ColwiseParallel{.use_local_output = false})},
                                        {"fc2", tp::style(tp::RowwiseParallel{})}});
  bool sharded = false;  // what fc1 hands to ReLU
  model->fc1->register_forward_hook([&](nn::Module&, const TensorList&, TensorList& out) {
    sharded = is_dtensor(out[0]) && dtensor_spec(out[0]).placements == Placements{Shard{2}};
  });
  model->to_empty(Device::cpu());
  model->init_weights(3);
  model->to(DType::F64);
  Tensor x = randn({4, 3, 7}, 21, DType::F64), probe = randn({4, 3, 5}, 22, DType::F64);
  autograd::backward(sum(ref(x) * probe));
  Tensor y = (*model)(x);
  CHECK(sharded);
  autograd::backward(sum(y * probe));
  CHECK_CLOSE(y, ref(x), 1e-12, 1e-14);
  check_parity(*model, ref, 1e-12, true);
}

TEST_CASE("a Llama whose attention and MLP run on DTensors follows one process", "[tp][dtensor]") {
  // The column-wise projections hand on their DTensors (use_local_output
  // false): the model's own code splits heads (reshape, transpose), rotates
  // (RoPE), attends, merges heads and multiplies the MLP's halves on DTensors
  // split on heads or features; the row-wise layers take them as they are.
  MeshPtr mesh = tp_mesh();
  const int w = world();
  nn::TransformerConfig c = llama_config(w);
  if (w == 3) c.n_kv_head = 3;  // 12 query heads over 3 key/value heads: 4 and 1 per rank
  nn::Llama ref(c);
  ref.init_weights(8);
  ref.to(DType::F64);
  auto model = nn::Llama::on_meta(c);
  const auto col = tp::style(tp::ColwiseParallel{.use_local_output = false}), row = tp::style(tp::RowwiseParallel{});
  const auto once = tp::style(tp::PrepareModuleInput{.input_layout = Replicate{}, .desired_input_layout = Replicate{}});
  bool heads_split = false;  // what attention sees
  tp::parallelize_module(*model, mesh,
                         {{"model.layers.*.self_attn", once},       {"model.layers.*.mlp", once},
                          {"model.layers.*.self_attn.q_proj", col}, {"model.layers.*.self_attn.k_proj", col},
                          {"model.layers.*.self_attn.v_proj", col}, {"model.layers.*.self_attn.o_proj", row},
                          {"model.layers.*.mlp.gate_proj", col},    {"model.layers.*.mlp.up_proj", col},
                          {"model.layers.*.mlp.down_proj", row}});
  nn::Module* o_proj = nullptr;
  for (auto& [fqn, m] : model->named_modules())
    if (fqn == "model.layers.0.self_attn.o_proj") o_proj = m;
  REQUIRE(o_proj != nullptr);
  o_proj->register_forward_hook([&](nn::Module&, const TensorList& in, TensorList&) {
    heads_split = is_dtensor(in[0]) && dtensor_spec(in[0]).placements == Placements{Shard{2}};
  });
  model->to_empty(Device::cpu());
  model->init_weights(8);
  model->to(DType::F64);
  check_parity(*model, ref, 0, false);
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref.parameters(), o), topt(model->parameters(), o);
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    Tensor x = randint({3, 7}, 0, c.vocab_size, 60 + step), y = randint({3, 7}, 0, c.vocab_size, 70 + step);
    Tensor rloss = nn::cross_entropy(ref(x), y);
    autograd::backward(rloss);
    mesh->get_group(0)->reset_stats();
    Tensor tloss = nn::cross_entropy((*model)(x), y);
    CHECK(heads_split);
    // Megatron's count: one all-reduce per attention and MLP, nothing gathered.
    const int64_t on = w > 1 ? 1 : 0;
    CHECK(stats(mesh).all_reduce == on * 2 * c.n_layer);
    CHECK(stats(mesh).all_gather == 0);
    autograd::backward(tloss);
    CHECK(stats(mesh).all_reduce == on * 4 * c.n_layer);
    CHECK(stats(mesh).all_gather + stats(mesh).reduce_scatter == 0);
    CHECK(tloss.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, ref, topt, ropt);
  }
}

TEST_CASE("loss parallelism: cross-entropy on class-sharded logits, never gathered", "[tp][loss]") {
  const int w = world();
  // 13 classes: shards of 7+6, 5+5+3, 4+4+4+1; 2 classes: at 3 and 4 ranks some ranks hold none.
  for (int64_t classes : {13, 2}) {
    INFO(classes << " classes");
    Tensor logits = ops::mul(randn({11, classes}, 31, DType::F64), 3.0);
    Tensor target = randint({11}, 0, classes, 32);
    ops::copy_(ops::narrow(target, 0, 4, 2), full({2}, -100.0, DType::I64));  // two ignored rows
    Tensor ref = ops::clone(logits);
    ref.set_requires_grad(true);
    Tensor ref_loss = cross_entropy(ref, target);
    autograd::backward(ref_loss);

    MeshPtr mesh = tp_mesh();
    Tensor x = ops::clone(logits);
    x.set_requires_grad(true);
    Tensor xs = distribute_tensor_local(x, mesh, {Shard{1}});  // a leaf: each rank its columns
    mesh->get_group(0)->reset_stats();
    Tensor loss = cross_entropy(xs, target);
    // The row maximum, the sum of exponentials and the target logit: one all-reduce each (none on one rank).
    auto s = stats(mesh);
    CHECK(s.all_reduce == (w > 1 ? 3 : 0));
    CHECK(s.all_gather + s.reduce_scatter + s.broadcast + s.all_to_all == 0);
    REQUIRE(is_dtensor(loss));
    CHECK(dtensor_spec(loss).placements == Placements{Replicate{}});
    CHECK(std::abs(local_tensor(loss).item() - ref_loss.item()) <= 1e-13 * std::abs(ref_loss.item()));
    autograd::backward(loss);
    CHECK(stats(mesh).all_reduce == s.all_reduce);  // the backward needs no communication
    REQUIRE(xs.grad().defined());
    CHECK(dtensor_spec(xs.grad()).placements == Placements{Shard{1}});
    CHECK_CLOSE(full_tensor(xs.grad()), ref.grad(), 1e-12, 1e-15);
  }
}

TEST_CASE("nn::cross_entropy on DTensor logits: class-sharded [B, T, V], and pending sums", "[tp][loss]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  Tensor logits = randn({2, 3, 11}, 51, DType::F64), target = randint({2, 3}, 0, 11, 52);
  Tensor ref = ops::clone(logits);
  ref.set_requires_grad(true);
  Tensor ref_loss = nn::cross_entropy(ref, target);
  autograd::backward(ref_loss);
  // Shard(2): the leading dims flattened on each rank's block.
  Tensor x = ops::clone(logits);
  x.set_requires_grad(true);
  Tensor xs = distribute_tensor_local(x, mesh, {Shard{2}});
  Tensor loss = nn::cross_entropy(xs, target);
  CHECK_FALSE(is_dtensor(loss));
  CHECK(loss.item() == Approx(ref_loss.item()).epsilon(1e-13));
  autograd::backward(loss);
  CHECK_CLOSE(full_tensor(xs.grad()), ref.grad(), 1e-12, 1e-15);
  // Partial: each rank holds 1/w of the logits; each part's gradient is the whole's.
  Tensor part = ops::mul(logits, 1.0 / w);
  part.set_requires_grad(true);
  Tensor pending = from_local(part, mesh, {Partial{}}, logits.shape());
  Tensor ploss = nn::cross_entropy(pending, target);
  CHECK(ploss.item() == Approx(ref_loss.item()).epsilon(1e-12));
  autograd::backward(ploss);
  REQUIRE(part.grad().defined());
  CHECK_CLOSE(part.grad(), ref.grad(), 1e-12, 1e-15);
}

TEST_CASE("loss parallelism on a 2-D mesh: rows over one dim, classes over the other", "[tp][loss]") {
  const int w = world();
  if (w % 2 != 0) return;  // 2 x (w / 2) meshes only
  for (auto [rows_ranks, class_ranks] : {std::pair{2, w / 2}, std::pair{w / 2, 2}}) {
    INFO(rows_ranks << " x " << class_ranks);
    MeshPtr mesh = init_device_mesh("cpu", {rows_ranks, class_ranks}, {"dp", "tp"});
    Tensor logits = randn({9, 7}, 41, DType::F64), target = randint({9}, 0, 7, 42);
    ops::copy_(ops::narrow(target, 0, 8, 1), full({1}, 3.0, DType::I64));
    Tensor ref = ops::clone(logits);
    ref.set_requires_grad(true);
    Tensor ref_loss = cross_entropy(ref, target, /*ignore_index=*/3);  // a class as the ignored index
    autograd::backward(ref_loss);
    Tensor x = ops::clone(logits);
    x.set_requires_grad(true);
    Tensor xs = distribute_tensor_local(x, mesh, {Shard{0}, Shard{1}});
    Tensor loss = cross_entropy(xs, target, 3);
    CHECK(std::abs(local_tensor(loss).item() - ref_loss.item()) <= 1e-13 * std::abs(ref_loss.item()));
    autograd::backward(loss);
    CHECK_CLOSE(full_tensor(xs.grad()), ref.grad(), 1e-12, 1e-15);
  }
}

TEST_CASE("loss parallelism refuses what it cannot split, naming it", "[tp][loss][errors]") {
  if (world() < 2) return;
  MeshPtr mesh = init_device_mesh("cpu", {world()}, {"tp"});
  Tensor logits = distribute_tensor_local(randn({6, 8}, 1), mesh, {Shard{1}});
  CHECK_THROWS_WITH(cross_entropy(logits, randint({5}, 0, 8, 2)), Catch::Contains("do not match logits"));
  CHECK_THROWS_WITH(cross_entropy(logits, randn({6}, 2)), Catch::Contains("targets must be i64"));
  // A target out of range on one rank's rows only: every rank refuses (none is left in a collective).
  MeshPtr grid = init_device_mesh("cpu", {world(), 1}, {"dp", "tp"});
  Tensor rows = distribute_tensor_local(randn({12, 8}, 3), grid, {Shard{0}, Replicate{}});
  Tensor bad = randint({12}, 0, 8, 4);
  ops::copy_(ops::narrow(bad, 0, 11, 1), full({1}, 8.0, DType::I64));  // in the last rank's rows
  CHECK_THROWS_WITH(cross_entropy(rows, bad), Catch::Contains("1 target(s) out of range for 8 classes"));
  ops::copy_(ops::narrow(bad, 0, 0, 1), full({1}, -3.0, DType::I64));
  CHECK_THROWS_WITH(cross_entropy(logits, ops::narrow(bad, 0, 0, 6)), Catch::Contains("out of range"));
  Tensor cube = distribute_tensor_local(randn({2, 3, 8}, 1), mesh, {Shard{2}});
  CHECK_THROWS_WITH(cross_entropy(cube, randint({2, 3}, 0, 8, 2)), Catch::Contains("logits must be [N, C]"));
}
