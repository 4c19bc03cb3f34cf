// GPT-2 under tensor parallelism, under mpirun with 1-4 ranks: its fused
// c_attn ([q | k | v]) split block by block (a blocked Shard, S(0)x3), so
// that each rank holds its heads' q, k and v. The blocked placement on its
// own (distribute, redistribute, init, boxes, nested inside FSDP's shard),
// then the model against one process (f64), with sequence parallelism and
// dropout, FSDP over it (2-D, and HSDP x TP 3-D at 4 ranks), and its
// checkpoints moving between layouts.
#include "fsdp/checkpoint.h"
#include "tests/tp/tp_helpers.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// This rank's chunk of each of `blocks` blocks of dim 0, in block order.
Tensor blocked_piece(const Tensor& full, int64_t blocks, int64_t k, int64_t r) {
  const int64_t n = full.size(0) / blocks;
  std::vector<Tensor> parts;
  for (int64_t j = 0; j < blocks; ++j) {
    auto [len, start] = shard_size_and_offset(n, k, r);
    parts.push_back(ops::narrow(full, 0, j * n + start, len));
  }
  return ops::contiguous(ops::cat(parts, 0));
}

// Every rank's boxes written into a global tensor and summed over the mesh:
// the tensor itself when each element is held once, and a count of ones.
void check_boxes_tile(const Tensor& d, const Tensor& full, const MeshPtr& mesh) {
  Tensor sum = zeros(full.shape(), DType::F64), count = zeros(full.shape(), DType::F64);
  for (const LocalBox& box : local_boxes(d)) {
    Tensor at = sum, seen = count;
    for (size_t i = 0; i < box.offset.size(); ++i) {
      at = ops::narrow(at, static_cast<int64_t>(i), box.offset[i], box.shape[i]);
      seen = ops::narrow(seen, static_cast<int64_t>(i), box.offset[i], box.shape[i]);
    }
    ops::copy_(at, box.local);
    ops::fill_(seen, 1.0);
  }
  mesh->flat_group()->all_reduce(sum, {dist::ReduceOp::Sum})->wait();
  mesh->flat_group()->all_reduce(count, {dist::ReduceOp::Sum})->wait();
  CHECK(equal(count, ones(full.shape(), DType::F64)));
  CHECK(equal(sum, full));
}

nn::TransformerConfig gpt_config() {
  nn::TransformerConfig c = tp_test_config();  // 12 heads: 12 / 1, 2, 3, 4 per rank
  c.bias = true;
  return c;
}

std::shared_ptr<nn::GPT> tp_gpt(const nn::TransformerConfig& c, const MeshPtr& mesh, uint64_t seed,
                                bool loss_parallel = false, bool sequence_parallel = false) {
  return tp_model<nn::GPT>(c, mesh, seed, loss_parallel, sequence_parallel);
}

std::shared_ptr<nn::GPT> reference_gpt(const nn::TransformerConfig& c, uint64_t seed) {
  auto ref = std::make_shared<nn::GPT>(c);
  ref->init_weights(seed);
  ref->to(DType::F64);
  return ref;
}

}  // namespace

TEST_CASE("a blocked shard holds this rank's chunk of every block, through distribute, redistribute and boxes",
          "[tp][blocked]") {
  MeshPtr mesh = tp_mesh();
  const int w = world(), r = dist::rank();
  CHECK(placement_str(Shard{0, 3}) == "S(0)x3");
  CHECK(Placement{Shard{0, 3}} != Placement{Shard{0}});
  // 3 blocks of 5 rows: 3+2 at 2 ranks, 2+2+1 at 3, 2+2+1+0 at 4 (the last rank holds none).
  Tensor full = randn({15, 4}, 7, DType::F64);
  const Placements blocked{Shard{0, 3}};
  Tensor d = distribute_tensor(full, mesh, blocked);
  CHECK(dtensor_spec(d).placements == blocked);
  CHECK(equal(local_tensor(d), blocked_piece(full, 3, w, r)));
  CHECK(equal(full_tensor(d), full));
  check_boxes_tile(d, full, mesh);
  const int64_t rows = shard_size_and_offset(5, w, r).first;
  CHECK(local_boxes(d).size() == (w == 1 ? 1u : rows > 0 ? 3u : 1u));
  if (w > 1 && rows > 0) {
    CHECK_THROWS_WITH(local_box(d), Catch::Contains("blocked shard"));
    CHECK(local_boxes(d)[1].offset == Shape{5 + shard_size_and_offset(5, w, r).second, 0});
  }
  // To and from every other placement, and from a Partial sum (a reduce-scatter per block).
  for (const Placements& other : {Placements{Replicate{}}, Placements{Shard{0}}, Placements{Shard{1}}}) {
    INFO(placements_str(other));
    Tensor there = redistribute(d, other);
    CHECK(equal(full_tensor(there), full));
    CHECK(equal(local_tensor(redistribute(there, blocked)), local_tensor(d)));
  }
  Tensor part = from_local(ops::mul(full, static_cast<double>(r + 1)), mesh, {Partial{}});
  CHECK_CLOSE(local_tensor(redistribute(part, blocked)), ops::mul(blocked_piece(full, 3, w, r), w * (w + 1) / 2.0),
              1e-14, 1e-14);
  // The rules that carry it: a sum over its dim is a Partial sum, over another
  // dim keeps it; elementwise ops keep it, moving a plainly split operand to it.
  Tensor col_sums = ops::sum(d, {0});
  CHECK(dtensor_spec(col_sums).placements == Placements{Partial{}});
  CHECK_CLOSE(full_tensor(col_sums), ops::sum(full, {0}), 1e-14, 1e-14);
  Tensor row_sums = ops::sum(d, {1});
  CHECK(dtensor_spec(row_sums).placements == blocked);
  CHECK_CLOSE(full_tensor(row_sums), ops::sum(full, {1}), 1e-14, 1e-14);
  Tensor other = randn({15, 4}, 17, DType::F64);
  Tensor both = ops::add(d, distribute_tensor(other, mesh, {Shard{0}}));
  CHECK(dtensor_spec(both).placements == blocked);
  CHECK(equal(full_tensor(both), ops::add(full, other)));
  Tensor to_partial = redistribute(d, {Partial{}});
  CHECK_CLOSE(full_tensor(to_partial), full, 1e-14, 1e-14);
  // A dim that is not three equal blocks is refused, naming the sizes.
  CHECK_THROWS_WITH(distribute_tensor(randn({16, 4}, 8, DType::F64), mesh, blocked),
                    Catch::Contains("does not split into 3 equal blocks"));
  for (int64_t bad : {0, -2}) {
    INFO("blocks " << bad);
    CHECK_THROWS_WITH(distribute_tensor(full, mesh, {Shard{0, bad}}), Catch::Contains("needs at least one block"));
    CHECK_THROWS_WITH(from_local(local_tensor(d), mesh, {Shard{0, bad}}), Catch::Contains("needs at least one block"));
    CHECK_THROWS_WITH(redistribute(d, {Shard{1, bad}}), Catch::Contains("needs at least one block"));
  }
  // Ops without a rule for it refuse it rather than split it the plain way.
  CHECK_THROWS_WITH(ops::softmax(d, 0), Catch::Contains("blocked shard"));

  // Nested: FSDP's shard of the tensor-parallel piece on a 2-D mesh (the
  // piece's rows split again, some falling across two blocks).
  if (w == 4) {
    MeshPtr two = init_device_mesh("cpu", {2, 2}, {"tp", "dp"});
    Tensor full2 = randn({24, 3}, 9, DType::F64);  // blocks of 8: 4 per tp rank, 6 rows of 12, 2 per dp rank
    Tensor n = distribute_tensor(full2, two, {Shard{0, 3}, Shard{0}});
    Tensor tp_piece = blocked_piece(full2, 3, 2, two->get_local_rank(0));
    CHECK(equal(local_tensor(n), ops::narrow(tp_piece, 0, 6 * two->get_local_rank(1), 6)));
    CHECK(equal(full_tensor(n), full2));
    check_boxes_tile(n, full2, two);
    CHECK(equal(full_tensor(redistribute(n, {Replicate{}, Shard{0}})), full2));
  }
}

TEST_CASE("a fused projection split block by block gives the unsplit layer's values and gradients",
          "[tp][blocked]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  // Linear(7, 3 x 12): 12 outputs per block, 6+6, 4+4+4, 3+3+3+3.
  nn::Linear ref(7, 36, true);
  ref.init_weights(3);
  ref.to(DType::F64);
  nn::Linear fused(7, 36, true, Device::meta());
  tp::parallelize_module(fused, mesh, {{"", tp::style(tp::ColwiseParallel{.blocks = 3})}});
  CHECK_THROWS_WITH(tp::parallelize_module(*std::make_shared<nn::Linear>(7, 35, true, Device::meta()), mesh,
                                           {{"", tp::style(tp::ColwiseParallel{.blocks = 3})}}),
                    Catch::Contains("splits '' as 3 fused outputs, but its 35 output features are not 3 equal blocks"));
  CHECK(dtensor_spec(fused.weight).placements == Placements{Shard{0, 3}});
  CHECK(dtensor_spec(fused.bias).placements == Placements{Shard{0, 3}});
  fused.to_empty(Device::cpu());
  fused.init_weights(3);  // each block's rows draw their own elements of the full init
  fused.to(DType::F64);
  check_parity(fused, ref, 0, false);
  Tensor x0 = randn({2, 5, 7}, 11, DType::F64), probe = randn({2, 5, 36}, 12, DType::F64);
  Tensor xr = ops::clone(x0), xt = ops::clone(x0);
  xr.set_requires_grad(true);
  xt.set_requires_grad(true);
  autograd::backward(sum(ref(xr) * probe));
  Tensor yt = fused(xt);  // this rank's q, k and v features, side by side
  CHECK_FALSE(is_dtensor(yt));
  CHECK(equal(yt, ops::contiguous(ops::transpose(blocked_piece(ops::contiguous(ops::transpose(ref(x0), 0, 2)), 3, w,
                                                                dist::rank()),
                                                 0, 2))));
  Tensor probe_mine = ops::contiguous(
      ops::transpose(blocked_piece(ops::contiguous(ops::transpose(probe, 0, 2)), 3, w, dist::rank()), 0, 2));
  autograd::backward(sum(yt * probe_mine));
  CHECK_CLOSE(xt.grad(), xr.grad(), 1e-12, 1e-14);
  check_parity(fused, ref, 1e-12, true);
}

TEST_CASE("GPT-2 with tensor parallelism follows one process over AdamW steps, with Megatron's collectives",
          "[tp][gpt][parity]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  nn::TransformerConfig c = gpt_config();
  const bool loss_parallel = GENERATE(false, true);
  c.tie_embeddings = GENERATE(false, true);
  INFO("loss parallel " << loss_parallel << ", tied " << c.tie_embeddings);
  auto ref = reference_gpt(c, 5);
  auto model = tp_gpt(c, mesh, 5, loss_parallel);
  const bool head_split = loss_parallel || c.tie_embeddings;
  CHECK(dtensor_spec(model->wte->weight).placements == Placements{Shard{0}});
  CHECK_FALSE(is_dtensor(model->wpe->weight));  // the positions stay whole
  const Tensor qkv = *nn::find_in(model->state_dict(), "transformer.h.1.attn.c_attn.weight");
  CHECK(dtensor_spec(qkv).placements == Placements{Shard{0, 3}});
  CHECK(local_tensor(qkv).size(0) == 3 * c.n_embd / w);
  check_parity(*model, *ref, 0, false);

  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref->parameters(), o), topt(model->parameters(), o);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({3, 7}, 0, c.vocab_size, 40 + step), y = randint({3, 7}, 0, c.vocab_size, 50 + step);
    Tensor rloss = nn::cross_entropy((*ref)(x), y);
    autograd::backward(rloss);
    mesh->get_group(0)->reset_stats();
    Tensor tloss = nn::cross_entropy((*model)(x), y);
    const int64_t on = w > 1 ? 1 : 0, per_layer = on * 2 * c.n_layer;
    const int64_t loss = on * (loss_parallel ? 3 : 0), head_input = on * (head_split ? 1 : 0);
    const int64_t gathered = on * (c.tie_embeddings && !loss_parallel ? 1 : 0);
    CHECK(stats(mesh).all_reduce == per_layer + on + loss);  // attention, MLP, the embedding's rows
    CHECK(stats(mesh).all_gather == gathered);
    autograd::backward(tloss);
    const auto s = stats(mesh);
    CHECK(s.all_reduce == 2 * per_layer + on + loss + head_input);
    CHECK(s.all_gather == gathered);
    CHECK(s.reduce_scatter + s.broadcast + s.all_to_all == 0);
    CHECK(tloss.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, *ref, topt, ropt);
  }
  check_parity(*model, *ref, 1e-10, false);
}

TEST_CASE("GPT-2 with sequence parallelism and dropout follows one process", "[tp][gpt][sp]") {
  MeshPtr mesh = tp_mesh();
  const int w = world();
  nn::TransformerConfig c = gpt_config();
  c.dropout = 0.25;  // the masks drawn for global positions: every layout drops the same elements
  const bool loss_parallel = GENERATE(false, true);
  c.tie_embeddings = GENERATE(false, true);
  INFO("loss parallel " << loss_parallel << ", tied " << c.tie_embeddings);
  const bool head_split = loss_parallel || c.tie_embeddings;
  auto ref = reference_gpt(c, 6);
  auto model = tp_gpt(c, mesh, 6, loss_parallel, /*sequence_parallel=*/true);
  CHECK(dtensor_spec(*nn::find_in(model->state_dict(), "transformer.h.1.ln_2.bias")).placements == Placements{Replicate{}});
  check_parity(*model, *ref, 0, false);
  Tensor seen;
  model->submodule("transformer.h.0").register_forward_hook(
      [&](nn::Module&, const TensorList&, TensorList& out) { seen = out[0]; });
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref->parameters(), o), topt(model->parameters(), o);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({3, 7}, 0, c.vocab_size, 140 + step), y = randint({3, 7}, 0, c.vocab_size, 150 + step);
    const int64_t offset = default_generator().offset();
    Tensor rloss = nn::cross_entropy((*ref)(x), y);
    autograd::backward(rloss);
    default_generator().set_offset(offset);  // the same draws for the split model
    mesh->get_group(0)->reset_stats();
    Tensor tloss = nn::cross_entropy((*model)(x), y);
    REQUIRE(is_dtensor(seen));
    CHECK(dtensor_spec(seen).placements == Placements{Shard{1}});
    // Forward: the embedding's rows all-reduced (then split locally, after the
    // positions are added); per block, attention's and the MLP's inputs
    // all-gathered and outputs reduce-scattered; the output layer's input gathered.
    const int64_t on = w > 1 ? 1 : 0, L = c.n_layer;
    auto f = stats(mesh);
    CHECK(f.all_gather == on * (2 * L + 1 + (c.tie_embeddings && !loss_parallel ? 1 : 0)));
    CHECK(f.reduce_scatter == on * 2 * L);
    CHECK(f.all_reduce == on * (1 + (loss_parallel ? 3 : 0)));
    autograd::backward(tloss);
    // Backward mirrors it; the split at the dropout gathers its gradient, and
    // each norm's weight and bias gradients are all-reduced once.
    auto b = stats(mesh);
    CHECK(b.all_gather - f.all_gather == on * (2 * L + 1));
    CHECK(b.reduce_scatter - f.reduce_scatter == on * (2 * L + (head_split ? 1 : 0)));
    CHECK(b.all_reduce - f.all_reduce == on * 2 * (2 * L + 1));
    CHECK(b.broadcast + b.all_to_all == 0);
    CHECK(tloss.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, *ref, topt, ropt);
  }
  check_parity(*model, *ref, 1e-10, false);
}

namespace {
void run_fsdp_tp_gpt(const Shape& shape, const std::vector<std::string>& names, bool sp) {
  INFO("mesh " << shape_str(shape) << (sp ? ", sequence parallel" : ""));
  MeshPtr mesh = init_device_mesh("cpu", shape, names);
  const int64_t tp = mesh->size(-1), dp = mesh->size() / tp;
  const std::vector<std::string> dp_names(names.begin(), names.end() - 1);
  const nn::TransformerConfig c = gpt_config();
  auto ref = reference_gpt(c, 5);
  auto model = fsdp_tp_model<nn::GPT>(c, mesh, dp_names, 5, sp);
  // c_attn: each block's tensor-parallel rows, FSDP's chunk of them inside.
  const Tensor qkv = *nn::find_in(model->state_dict(), "transformer.h.0.attn.c_attn.weight");
  CHECK(dtensor_spec(qkv).placements.front() == Placement{Shard{0, 3}});
  CHECK(dtensor_spec(qkv).placements.back() == Placement{Shard{0}});
  check_parity(*model, *ref, 0, false);
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW ropt(ref->parameters(), o), topt(model->parameters(), o);
  const int64_t rows = 2, r = dp_rank_of(mesh);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    Tensor x = randint({rows * dp, 7}, 0, c.vocab_size, 80 + step);
    Tensor y = randint({rows * dp, 7}, 0, c.vocab_size, 90 + step);
    Tensor rloss = nn::cross_entropy((*ref)(x), y);
    autograd::backward(rloss);
    Tensor tloss = nn::cross_entropy((*model)(ops::narrow(x, 0, r * rows, rows)), ops::narrow(y, 0, r * rows, rows));
    autograd::backward(tloss);
    Tensor mean = ops::reshape(ops::clone(detach(tloss)), {1});
    mesh->slice(dp_names)->flat_group()->all_reduce(mean, {dist::ReduceOp::Avg})->wait();
    CHECK(mean.item() == Approx(rloss.item()).epsilon(1e-12));
    clip_compare_and_step(*model, *ref, topt, ropt);
  }
  check_parity(*model, *ref, 1e-10, false);
}
}  // namespace

TEST_CASE("FSDP over GPT-2's tensor parallelism (2-D) and HSDP over it (3-D) follow one process",
          "[tp][gpt][fsdp][parity]") {
  const int w = world();
  for (int tp : {1, 2, 3, 4}) {
    if (w % tp != 0 || (tp == 4 && w != 4)) continue;
    run_fsdp_tp_gpt({w / tp, tp}, {"dp", "tp"}, false);
  }
  if (w > 1) run_fsdp_tp_gpt({w / (w == 4 ? 2 : w), w == 4 ? 2 : w}, {"dp", "tp"}, true);
  if (w == 4) run_fsdp_tp_gpt({2, 1, 2}, {"replicate", "shard", "tp"}, false);
}

TEST_CASE("GPT-2 checkpoints move between FSDP x TP, TP, FSDP and one process", "[tp][gpt][checkpoint]") {
  const int w = world();
  const int64_t tp = w == 4 ? 2 : w;
  const nn::TransformerConfig c = gpt_config();
  optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  MeshPtr mesh = init_device_mesh("cpu", {w / tp, tp}, {"dp", "tp"});
  auto two_d = fsdp_tp_model<nn::GPT>(c, mesh, {"dp"}, 5);
  optim::AdamW two_d_opt(two_d->parameters(), o);
  train_rows(*two_d, two_d_opt, 100, mesh->get_local_rank(0), mesh->size(0), c.vocab_size);
  SharedDir a, b;
  fsdp::save_checkpoint(a.path.string(), 1, *two_d, &two_d_opt);
  const std::string dir = fsdp::latest_checkpoint(a.path.string());
  check_chunks_tile(dir);
  // Loaded by one process, by tensor parallelism over every rank, and by FSDP
  // over every rank: the same values, bit for bit.
  nn::GPT plain(c);
  plain.to(DType::F64);
  optim::AdamW plain_opt(plain.parameters(), o);
  fsdp::load_checkpoint(dir, plain, &plain_opt);
  auto split = tp_gpt(c, init_device_mesh("cpu", {w}, {"tp"}), 99);
  optim::AdamW split_opt(split->parameters(), o);
  fsdp::load_checkpoint(dir, *split, &split_opt);
  MeshPtr flat = init_device_mesh("cpu", {w, 1}, {"dp", "tp"});
  auto fsdp_only = fsdp_tp_model<nn::GPT>(c, flat, {"dp"}, 98);
  optim::AdamW fsdp_opt(fsdp_only->parameters(), o);
  fsdp::load_checkpoint(dir, *fsdp_only, &fsdp_opt);
  for (nn::Module* loaded : {static_cast<nn::Module*>(&plain), static_cast<nn::Module*>(split.get()),
                             static_cast<nn::Module*>(fsdp_only.get())}) {
    INFO(loaded->type_name());
    check_equal_params(*loaded, *two_d);
  }
  // And the moments came along: one more step of each agrees.
  Tensor x = randint({12, 7}, 0, c.vocab_size, 110), y = randint({12, 7}, 0, c.vocab_size, 111);
  autograd::backward(nn::cross_entropy(plain(x), y));
  autograd::backward(nn::cross_entropy((*split)(x), y));
  plain_opt.step();
  split_opt.step();
  check_parity(*split, plain, 1e-10, false);
  // Saved by tensor parallelism, read back as FSDP x TP.
  fsdp::save_checkpoint(b.path.string(), 2, *split, &split_opt);
  auto again = fsdp_tp_model<nn::GPT>(c, mesh, {"dp"}, 97);
  optim::AdamW again_opt(again->parameters(), o);
  fsdp::load_checkpoint(fsdp::latest_checkpoint(b.path.string()), *again, &again_opt);
  check_equal_params(*again, *split);
}
