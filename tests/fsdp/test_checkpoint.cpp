// State dicts and checkpoints inside one program at 1-4 ranks: sharded state
// dicts alias the shards, full state dicts stream one parameter at a time,
// checkpoints round-trip with keep-K and training state, corrupt or
// mismatched checkpoints fail with the file and tensor named on every rank,
// and safetensors export/import of a sharded model. (Loading at another world
// size, exact resume and a killed save: checkpoint_test.sh.)
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <nlohmann/json.hpp>

#include "fsdp/checkpoint.h"
#include "fsdp/state_dict.h"
#include "nn/safetensors.h"
#include "runtime/allocator.h"
#include "tests/fsdp/fsdp_helpers.h"

using namespace tessera;
using namespace tessera::testing;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

nn::TransformerConfig small_gpt(int64_t n_layer = 2, int64_t n_embd = 12) {
  nn::TransformerConfig c;
  c.vocab_size = 4 * world() + 1;  // uneven rows
  c.block_size = 8;
  c.n_layer = n_layer;
  c.n_head = 2;
  c.n_embd = n_embd;
  return c;
}

std::shared_ptr<nn::GPT> sharded_gpt(const nn::TransformerConfig& c, uint64_t seed,
                                     MeshPtr mesh = nullptr) {
  if (!mesh) mesh = init_device_mesh("cpu", {world()}, {"dp"});
  auto model = nn::GPT::on_meta(c);
  for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = mesh});
  fsdp::fully_shard(*model, {.mesh = mesh});
  model->to_empty(Device::cpu());
  model->init_weights(seed);
  return model;
}

void train_steps(nn::GPT& model, optim::AdamW& opt, int steps) {
  for (int s = 0; s < steps; ++s) {
    Tensor x = randint({12, 8}, 0, model.config.vocab_size, 50 + static_cast<uint64_t>(s));
    Tensor loss = nn::cross_entropy(model(local_rows(x)), local_rows(x));
    autograd::backward(loss);
    opt.step();
    opt.zero_grad();
  }
}

void barrier() {
  dist::world()->barrier()->wait();
}

// Every local shard of a equals b's.
void check_same_shards(nn::Module& a, nn::Module& b) {
  auto pa = a.state_dict(), pb = b.state_dict();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    REQUIRE(pa[i].first == pb[i].first);
    CHECK(equal(local_tensor(pa[i].second), local_tensor(pb[i].second)));
  }
}

}  // namespace

TEST_CASE("CRC-32C: the standard check value; instruction and portable paths agree",
          "[checkpoint][crc]") {
  const char* check = "123456789";
  CHECK(fsdp::crc32c(check, 9) == 0xE3069283u);
  CHECK(fsdp::detail::crc32c_software(check, 9) == 0xE3069283u);
  Tensor r = randn({1000}, 5);
  const auto* bytes = static_cast<const unsigned char*>(r.data_ptr());
  for (size_t off : {size_t{0}, size_t{1}, size_t{3}, size_t{7}}) {
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{63}, 3999 - off}) {
      uint32_t hw = fsdp::crc32c(bytes + off, n),
               sw = fsdp::detail::crc32c_software(bytes + off, n);
      CHECK(hw == sw);
      // Chaining: crc(a ++ b) == crc(b, crc(a)).
      CHECK(fsdp::crc32c(bytes + off + n / 2, n - n / 2, fsdp::crc32c(bytes + off, n / 2)) == hw);
    }
  }
}

TEST_CASE("sharded state dict aliases the shards; keys are the unsharded model's",
          "[checkpoint][state_dict]") {
  auto c = small_gpt();
  auto model = sharded_gpt(c, 3);
  nn::GPT reference(c);
  auto sd = model->state_dict();
  auto ref_sd = reference.state_dict();
  REQUIRE(sd.size() == ref_sd.size());
  auto params = model->named_parameters();
  for (size_t i = 0; i < sd.size(); ++i) {
    INFO(sd[i].first);
    CHECK(sd[i].first == ref_sd[i].first);
    REQUIRE(is_dtensor(sd[i].second));
    CHECK(sd[i].second.shape() == ref_sd[i].second.shape());
    if (const Tensor* p = nn::find_in(params, sd[i].first))
      CHECK(local_tensor(sd[i].second).data_ptr() == local_tensor(*p).data_ptr());  // no copy
  }

  // load_state_dict of DTensors copies into the existing shards.
  auto other = sharded_gpt(c, 99);
  std::vector<const void*> before;
  for (auto& [k, v] : model->state_dict()) before.push_back(local_tensor(v).data_ptr());
  model->load_state_dict(other->state_dict());
  check_same_shards(*model, *other);
  auto after = model->state_dict();
  for (size_t i = 0; i < after.size(); ++i)
    CHECK(local_tensor(after[i].second).data_ptr() == before[i]);

  // Optimizer state: sharded moments aliasing the optimizer's, keyed by FQN.
  optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  train_steps(*model, opt, 1);
  auto osd = opt.state_dict(model->named_parameters());
  const Tensor* m = nn::find_in(osd, "transformer.h.1.attn.c_attn.weight.exp_avg");
  REQUIRE(m != nullptr);
  REQUIRE(is_dtensor(*m));
  CHECK(m->shape() == Shape{36, 12});
  const Tensor* step = nn::find_in(osd, "transformer.h.1.attn.c_attn.weight.step");
  REQUIRE(step != nullptr);
  CHECK(step->item() == 1);
  bool aliased = false;
  for (size_t j = 0; j < opt.param_groups().at(0).params.size(); ++j)
    if (local_tensor(opt.state(0, j).exp_avg).data_ptr() == local_tensor(*m).data_ptr())
      aliased = true;
  CHECK(aliased);
}

TEST_CASE("full state dict: rank 0 only or all, one parameter in memory at a time",
          "[checkpoint][state_dict]") {
  auto c = small_gpt(2, 24);
  c.vocab_size = 64 * world() + 3;  // the embedding is the largest parameter
  auto model = sharded_gpt(c, 5);
  nn::GPT reference(c);
  reference.init_weights(5);

  for (bool rank0_only : {true, false}) {
    auto full = fsdp::full_state_dict(*model, rank0_only);
    auto ref = reference.state_dict();
    if (rank0_only && dist::rank() != 0) {
      CHECK(full.empty());
      continue;
    }
    REQUIRE(full.size() == ref.size());
    for (size_t i = 0; i < full.size(); ++i) {
      INFO(full[i].first);
      CHECK(full[i].first == ref[i].first);
      CHECK(!is_dtensor(full[i].second));
      CHECK(equal(full[i].second, ref[i].second));
    }
  }

  // Streaming: the peak over the shards stays near one full parameter.
  int64_t largest = 0;
  for (auto& [k, v] : reference.state_dict())
    largest = std::max<int64_t>(largest, static_cast<int64_t>(v.nbytes()));
  reset_peak_memory_stats();
  int64_t base = memory_stats().allocated_bytes;
  int64_t seen = 0;
  fsdp::for_each_full_tensor(model->state_dict(), false, [&](const std::string&, const Tensor& t) {
    seen += static_cast<int64_t>(t.nbytes());
  });
  int64_t extra = memory_stats().peak_allocated_bytes - base;
  INFO("peak over shards " << extra << " B, largest parameter " << largest << " B, all parameters "
                           << seen << " B");
  CHECK(extra <= 2 * largest + 4096);  // the gathered tensor and its padded receive buffer
  CHECK(seen > 3 * largest);           // the bound is meaningful: the whole model is much larger
}

TEST_CASE("load_full_state_dict keeps only each rank's shard; errors on every rank",
          "[checkpoint][state_dict]") {
  auto c = small_gpt();
  nn::GPT reference(c);
  reference.init_weights(21);
  auto full = reference.state_dict();
  for (bool from_rank0 : {false, true}) {
    INFO("from_rank0 " << from_rank0);
    auto model = sharded_gpt(c, 1);
    nn::StateDict given = from_rank0 && dist::rank() != 0 ? nn::StateDict{} : full;
    fsdp::load_full_state_dict(*model, given, from_rank0);
    check_sharded_parity(*model, reference, 0, 0, false);

    nn::StateDict missing(full.begin() + 1, full.end());
    if (from_rank0 && dist::rank() != 0) missing.clear();
    REQUIRE_THROWS_WITH(fsdp::load_full_state_dict(*model, missing, from_rank0),
                        Contains("missing keys ['transformer.wte.weight']"));
    nn::StateDict wrong = given;
    if (!wrong.empty()) wrong[2].second = zeros({3, 3});
    REQUIRE_THROWS_WITH(fsdp::load_full_state_dict(*model, wrong, from_rank0),
                        Contains("size mismatch for"));
  }
}

TEST_CASE("checkpoint round trip keeps the newest K and the training state", "[checkpoint][dcp]") {
  SharedDir dir;
  auto c = small_gpt();
  auto model = sharded_gpt(c, 8);
  optim::AdamW opt(model->parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  for (int64_t step = 1; step <= 4; ++step) {
    train_steps(*model, opt, 1);
    fsdp::save_checkpoint(dir.path, step, *model, &opt,
                          fmt::format(R"({{"data_position": {}}})", step * 12), 2);
  }
  barrier();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"latest", "step-00000003", "step-00000004"});
  std::string latest = fsdp::latest_checkpoint(dir.path);
  CHECK(fs::path(latest).filename() == "step-00000004");

  auto fresh = sharded_gpt(c, 77);
  optim::AdamW fresh_opt(fresh->parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  uint64_t read_before = fsdp::checkpoint_bytes_read();
  auto md = fsdp::load_checkpoint(latest, *fresh, &fresh_opt);
  uint64_t read = fsdp::checkpoint_bytes_read() - read_before;
  {  // At the same world size each rank reads exactly the bytes of its own shards.
    uint64_t mine = 0;
    for (auto& [k, v] : fresh->state_dict()) mine += (is_dtensor(v) ? local_tensor(v) : v).nbytes();
    for (auto& [k, v] : fresh_opt.state_dict(fresh->named_parameters()))
      mine += (is_dtensor(v) ? local_tensor(v) : v).nbytes();
    uint64_t total = 0;
    for (auto& t : md.tensors)
      for (auto& ch : t.chunks) total += ch.bytes;
    CHECK(read == mine);
    if (world() > 1) CHECK(read < total);
  }
  CHECK(md.step == 4);
  CHECK(md.world_size == world());
  CHECK(md.extra_json == R"({"data_position":48})");
  check_same_shards(*fresh, *model);
  auto a = opt.state_dict(model->named_parameters()),
       b = fresh_opt.state_dict(fresh->named_parameters());
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK(a[i].first == b[i].first);
    CHECK(equal(is_dtensor(a[i].second) ? local_tensor(a[i].second) : a[i].second,
                is_dtensor(b[i].second) ? local_tensor(b[i].second) : b[i].second));
  }
  // One more step from both gives the same parameters.
  train_steps(*model, opt, 1);
  train_steps(*fresh, fresh_opt, 1);
  check_same_shards(*fresh, *model);

  // A plain (unsharded) model loads the same checkpoint whole.
  nn::GPT plain(c);
  fsdp::load_checkpoint(dir.path / "step-00000003", plain, nullptr);
  auto model3 = sharded_gpt(c, 0);
  fsdp::load_checkpoint(dir.path / "step-00000003", *model3, nullptr);
  check_sharded_parity(*model3, plain, 0, 0, false);
}

// A full disk (simulated by the test hook TESSERA_CHECKPOINT_FAIL_AT) while
// writing the `latest` pointer fails the save before its commit point, and the
// report is true; a failure after the commit (pruning) leaves a saved,
// loadable checkpoint and is no failure. The next save clears the leftovers.
TEST_CASE("a save commits at one point and reports what happened", "[checkpoint][commit]") {
  SharedDir dir;
  auto c = small_gpt();
  auto model = sharded_gpt(c, 5);
  auto read_latest = [&] {
    std::ifstream in(dir.path / "latest");
    std::string s;
    in >> s;
    return s;
  };
  auto names = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir.path))
      out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  };
  fsdp::save_checkpoint(dir.path, 1, *model, nullptr, "{}", 2);

  ::setenv("TESSERA_CHECKPOINT_FAIL_AT", "latest", 1);
  REQUIRE_THROWS_WITH(fsdp::save_checkpoint(dir.path, 2, *model, nullptr, "{}", 2),
                      Contains("latest.tmp' failed: No space left on device"));
  barrier();
  CHECK(fs::path(fsdp::latest_checkpoint(dir.path)).filename() == "step-00000001");
  CHECK(read_latest() == "step-00000001");

  ::setenv("TESSERA_CHECKPOINT_FAIL_AT", "prune", 1);
  optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  train_steps(*model, opt, 1);
  std::string third;
  REQUIRE_NOTHROW(third = fsdp::save_checkpoint(dir.path, 3, *model, nullptr, "{}", 1));
  ::unsetenv("TESSERA_CHECKPOINT_FAIL_AT");
  barrier();
  CHECK(fs::path(fsdp::latest_checkpoint(dir.path)).filename() == "step-00000003");
  CHECK(read_latest() == "step-00000003");
  auto fresh = sharded_gpt(c, 0);
  fsdp::load_checkpoint(third, *fresh, nullptr);
  check_same_shards(*fresh, *model);

  // The next save removes what the failed one left (step-2.tmp/, latest.tmp) and prunes.
  fsdp::save_checkpoint(dir.path, 4, *model, nullptr, "{}", 1);
  barrier();
  CHECK(names() == std::vector<std::string>{"latest", "step-00000004"});
  REQUIRE_THROWS_WITH(fsdp::save_checkpoint(dir.path, 5, *model, nullptr, "[1, 2]"),
                      Contains("extra state must be a JSON object"));
}

TEST_CASE("corrupt or mismatched checkpoints fail on every rank naming file and tensor",
          "[checkpoint][errors]") {
  SharedDir dir;
  auto c = small_gpt();
  auto model = sharded_gpt(c, 4);
  std::string good = fsdp::save_checkpoint(dir.path, 1, *model, nullptr);
  fs::path data = fs::path(good) / "rank-00000.bin", meta = fs::path(good) / "metadata.json";

  // Each case damages a copy of the checkpoint (rank 0 does it; everyone loads).
  auto damaged = [&](const std::string& name, const std::function<void(const fs::path&)>& damage) {
    fs::path copy = dir.path / name;
    if (dist::rank() == 0) {
      fs::copy(good, copy, fs::copy_options::recursive);
      damage(copy);
    }
    barrier();
    return copy.string();
  };
  auto rewrite = [](const fs::path& file, const std::function<void(std::string&)>& edit) {
    std::ifstream in(file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    edit(bytes);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  };
  auto load = [&](const std::string& d, nn::Module& m) { fsdp::load_checkpoint(d, m, nullptr); };
  auto fresh = sharded_gpt(c, 0);

  SECTION("truncated data file") {
    auto d =
        damaged("truncated", [](const fs::path& p) { fs::resize_file(p / "rank-00000.bin", 100); });
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("rank-00000.bin: truncated: tensor '") &&
                                             Contains("failed on rank 0"));
  }
  SECTION("a flipped byte") {
    auto d = damaged("flipped", [&](const fs::path& p) {
      rewrite(p / "rank-00000.bin", [](std::string& b) { b[b.size() / 2] ^= 0x10; });
    });
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("rank-00000.bin: checksum mismatch in tensor '"));
  }
  SECTION("wrong data file magic") {
    auto d = damaged("magic", [&](const fs::path& p) {
      rewrite(p / "rank-00000.bin", [](std::string& b) { b[0] = 'X'; });
    });
    REQUIRE_THROWS_WITH(load(d, *fresh),
                        Contains("rank-00000.bin: not a Tessera checkpoint data file"));
  }
  SECTION("newer data file version") {
    auto d = damaged("data-version", [&](const fs::path& p) {
      rewrite(p / "rank-00000.bin", [](std::string& b) { b[8] = 9; });
    });
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("rank-00000.bin: data file version 9 (this build reads 1)"));
  }
  SECTION("metadata that is not a Tessera checkpoint") {
    auto d = damaged("meta-magic", [&](const fs::path& p) {
      std::ofstream(p / "metadata.json", std::ios::trunc) << R"({"format": "something-else", "version": 1})";
    });
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("metadata.json: not a Tessera checkpoint (missing or wrong magic)"));
  }
  SECTION("newer metadata version") {
    auto d = damaged("version", [&](const fs::path& p) {
      rewrite(p / "metadata.json",
              [](std::string& b) { b.replace(b.find("\"version\": 1"), 12, "\"version\": 9"); });
    });
    REQUIRE_THROWS_WITH(
        load(d, *fresh),
        Contains("metadata.json: checkpoint version 9 (this build reads version 1)"));
  }
  SECTION("truncated metadata") {
    auto d =
        damaged("meta-trunc", [](const fs::path& p) { fs::resize_file(p / "metadata.json", 200); });
    REQUIRE_THROWS_WITH(load(d, *fresh),
                        Contains("metadata.json: checkpoint metadata is not valid JSON"));
  }
  // A crafted metadata file: wte's chunks replaced by two boxes whose element
  // counts add up but which overlap (box = {offsets, shape}; the bytes follow).
  auto overlapping = [&](const std::string& name, const std::vector<std::pair<Shape, Shape>>& boxes) {
    return damaged(name, [&](const fs::path& p) {
      rewrite(p / "metadata.json", [&](std::string& b) {
        auto md = nlohmann::json::parse(b);
        for (auto& t : md["tensors"]) {
          if (t["name"] != "transformer.wte.weight") continue;
          auto chunks = nlohmann::json::array();
          for (auto& [offsets, shape] : boxes) {
            auto c = t["chunks"][0];
            c["offsets"] = offsets;
            c["shape"] = shape;
            c["bytes"] = shape_numel(shape) * 4;
            chunks.push_back(c);
          }
          t["chunks"] = chunks;
        }
        b = md.dump(1);
      });
    });
  };
  const int64_t rows = c.vocab_size, cols = c.n_embd;
  SECTION("overlapping chunk boxes (a crafted file: the count of elements is right)") {
    int64_t k = rows / 2;  // rows k-1 .. rows-2: row k-1 twice, the last row never
    auto d = overlapping("overlap", {{{0, 0}, {k, cols}}, {{k - 1, 0}, {rows - k, cols}}});
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("chunks 0 and 1 of 'transformer.wte.weight' overlap"));
  }
  SECTION("chunk boxes overlapping in columns only, listed out of order") {
    int64_t k = cols / 2;  // column k-1 twice, the last column never
    auto d = overlapping("overlap-cols", {{{0, k - 1}, {rows, cols - k}}, {{0, 0}, {rows, k}}});
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("chunks 0 and 1 of 'transformer.wte.weight' overlap"));
  }
  // Metadata that parses but lies: each field is cross-checked and named.
  auto edit_metadata = [&](const std::string& name,
                           const std::function<void(nlohmann::json&)>& edit) {
    return damaged(name, [&](const fs::path& p) {
      rewrite(p / "metadata.json", [&](std::string& b) {
        auto md = nlohmann::json::parse(b);
        edit(md);
        b = md.dump(1);
      });
    });
  };
  SECTION("a negative step") {
    auto d = edit_metadata("negative-step", [](nlohmann::json& md) { md["step"] = -3; });
    REQUIRE_THROWS_WITH(load(d, *fresh),
                        Contains("metadata.json: step must be a count of steps (>= 0), got -3"));
  }
  SECTION("a step that contradicts the folder name") {
    auto d = edit_metadata("step-00000007", [](nlohmann::json&) {});  // saved at step 1
    REQUIRE_THROWS_WITH(
        load(d, *fresh),
        Contains("step 1 does not match the checkpoint's folder name 'step-00000007'"));
    REQUIRE_THROWS_WITH(load(d + "/", *fresh), Contains("folder name 'step-00000007'"));
  }
  SECTION("a folder name of more steps than any checkpoint has, and a save of as many") {
    auto d = edit_metadata("step-10000000000000000001", [](nlohmann::json&) {});
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("the folder name 'step-10000000000000000001' holds a step of "
                                                  "more than 18 digits"));
    REQUIRE_THROWS_WITH(fsdp::save_checkpoint(d + "-out", fsdp::kMaxCheckpointStep + 1, *fresh, nullptr),
                        Contains("save_checkpoint: step must be in [0, 999999999999999999], got 1000000000000000000"));
  }
  SECTION("a random stream that is not one") {
    auto d = edit_metadata("rank-state", [](nlohmann::json& md) {
      md["rank_state"][0]["offset"] = "soon";
    });
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("metadata.json: rank_state entry 0 must be"));
  }
  SECTION("extra state that is not an object") {
    auto d = edit_metadata("extra", [](nlohmann::json& md) { md["extra"] = 5; });
    REQUIRE_THROWS_WITH(load(d, *fresh),
                        Contains("metadata.json: extra must be an object, got number"));
  }
  SECTION("a shape far beyond the data files: refused before anything is allocated") {
    // wte as [2^40, 1] in one chunk of 4 TiB (the element count is consistent).
    auto d = edit_metadata("huge", [](nlohmann::json& md) {
      for (auto& t : md["tensors"]) {
        if (t["name"] != "transformer.wte.weight") continue;
        auto chunk = t["chunks"][0];
        chunk["offsets"] = {0, 0};
        chunk["shape"] = {1ull << 40, 1};
        chunk["bytes"] = (1ull << 40) * 4;
        t["shape"] = {1ull << 40, 1};
        t["chunks"] = nlohmann::json::array({chunk});
      }
    });
    auto md = fsdp::read_metadata(d);
    REQUIRE_THROWS_WITH(fsdp::read_full_tensor(d, *md.find("transformer.wte.weight")),
                        Contains("truncated: tensor 'transformer.wte.weight' needs bytes"));
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("'transformer.wte.weight' is [1099511627776, 1] "
                                                  "in the checkpoint but"));
  }
  SECTION("no metadata (an interrupted save)") {
    auto d = damaged("no-meta", [](const fs::path& p) { fs::remove(p / "metadata.json"); });
    REQUIRE_THROWS_WITH(load(d, *fresh), Contains("no checkpoint metadata"));
  }
  SECTION("a model with more layers: missing keys") {
    auto bigger = sharded_gpt(small_gpt(3), 0);
    REQUIRE_THROWS_WITH(load(good, *bigger), Contains("missing keys ['transformer.h.2.ln_1.weight"));
  }
  SECTION("a model with fewer layers: unexpected keys") {
    auto smaller = sharded_gpt(small_gpt(1), 0);
    REQUIRE_THROWS_WITH(load(good, *smaller),
                        Contains("unexpected keys ['transformer.h.1.ln_1.weight"));
  }
  SECTION("a wider model: shape mismatch") {
    auto wider = sharded_gpt(small_gpt(2, 16), 0);
    REQUIRE_THROWS_WITH(load(good, *wider), Contains("tensor 'transformer.wte.weight' is [") &&
                                                Contains("in the checkpoint but"));
  }
  SECTION("another dtype: dtype mismatch, unless converting is asked for") {
    auto f64 = sharded_gpt(c, 0);
    f64->to(DType::F64);
    REQUIRE_THROWS_WITH(load(good, *f64),
                        Contains("is f32 in the checkpoint but f64 in the model"));
    auto bf16 = sharded_gpt(c, 0);
    bf16->to(DType::BF16);
    fsdp::load_checkpoint(good, *bf16, nullptr, /*convert_dtypes=*/true);
    auto want = model->named_parameters(), got = bf16->named_parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      INFO(want[i].first);
      CHECK(equal(local_tensor(got[i].second), ops::to(local_tensor(want[i].second), DType::BF16)));
    }
  }
  // Every section leaves the model usable: a good load still works afterwards.
  load(good, *fresh);
  check_same_shards(*fresh, *model);
}

TEST_CASE("safetensors export and import of a sharded model", "[checkpoint][safetensors]") {
  SharedDir dir;
  auto c = small_gpt();
  nn::GPT reference(c);
  reference.init_weights(13);
  auto model = sharded_gpt(c, 13);
  std::string path = (dir.path / "gpt.safetensors").string();
  fsdp::save_safetensors(*model, path, {{"format", "pt"}});
  barrier();

  nn::SafetensorsFile file(path);
  CHECK(file.metadata().at("format") == "pt");
  auto ref = reference.state_dict();
  REQUIRE(file.entries().size() == ref.size());
  for (auto& [k, v] : ref) {
    INFO(k);
    CHECK(equal(file.read(k), v));
  }
  CHECK(file.find("transformer.h.1.attn.c_attn.weight") != nullptr);  // nanoGPT names
  CHECK(file.find("lm_head.weight") != nullptr);

  // Import into a fresh sharded model: each rank reads its rows only.
  auto fresh = sharded_gpt(c, 0);
  fsdp::load_safetensors(*fresh, path);
  check_sharded_parity(*fresh, reference, 0, 0, false);

  // bf16 export; the import converts back to f32 (values bf16-rounded).
  std::string bf = (dir.path / "gpt-bf16.safetensors").string();
  fsdp::save_safetensors(*model, bf, {}, DType::BF16);
  barrier();
  CHECK(nn::SafetensorsFile(bf).find("transformer.wte.weight")->dtype == DType::BF16);
  fsdp::load_safetensors(*fresh, bf);
  nn::GPT rounded(c);
  rounded.init_weights(13);
  rounded.to(DType::BF16);
  rounded.to(DType::F32);
  check_sharded_parity(*fresh, rounded, 0, 0, false);

  // A file without the tied lm_head (stored once, as Hugging Face does) still loads.
  std::string untied = (dir.path / "tied.safetensors").string();
  if (dist::rank() == 0) {
    nn::StateDict sd;
    for (auto& [k, v] : ref)
      if (k != "lm_head.weight") sd.emplace_back(k, v);
    nn::save_safetensors(untied, sd);
  }
  barrier();
  auto tied = sharded_gpt(c, 0);
  fsdp::load_safetensors(*tied, untied);
  check_sharded_parity(*tied, reference, 0, 0, false);

  // A Llama exports under Hugging Face names and reloads.
  nn::TransformerConfig lc = c;
  lc.n_kv_head = 1;
  nn::Llama llama(lc);
  llama.init_weights(2);
  std::string lp = (dir.path / "llama.safetensors").string();
  fsdp::save_safetensors(llama, lp);
  barrier();
  nn::SafetensorsFile lf(lp);
  for (const char* k :
       {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight", "lm_head.weight"})
    CHECK(lf.find(k) != nullptr);
  nn::Llama llama2(lc);
  fsdp::load_safetensors(llama2, lp);
  auto l1 = llama.state_dict(), l2 = llama2.state_dict();
  for (size_t i = 0; i < l1.size(); ++i) CHECK(equal(l1[i].second, l2[i].second));

  // A file for another model: named keys on every rank.
  REQUIRE_THROWS_WITH(
      fsdp::load_safetensors(*fresh, lp),
      Contains("missing keys ['transformer.wpe.weight', 'transformer.h.0.ln_1.weight',") &&
          Contains("(19 more)") && Contains("unexpected keys ['model.embed_tokens.weight"));
}

namespace {
// Every file under dir (relative name -> bytes).
std::map<std::string, std::string> files_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[fs::relative(e.path(), dir).string()] =
        std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return out;
}
}  // namespace

TEST_CASE("an asynchronous save writes save_checkpoint's files byte for byte while training goes on", "[checkpoint][async]") {
  SharedDir dir;
  auto c = small_gpt();
  auto model = sharded_gpt(c, 7);
  optim::AdamW opt(model->parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  train_steps(*model, opt, 2);
  const std::string extra = R"({"note": "same step, two ways"})";
  fsdp::save_checkpoint((dir.path / "sync").string(), 2, *model, &opt, extra, 0);
  auto before = model->state_dict();
  std::vector<Tensor> kept;
  for (auto& [name, t] : before) kept.push_back(ops::clone(local_tensor(t)));

  // A slow disk: the writer sleeps first, and the model trains meanwhile.
  ::setenv("TESSERA_CHECKPOINT_WRITE_DELAY_MS", "300", 1);
  fsdp::AsyncCheckpointer async;
  CHECK(async.prepare(*model, &opt) > 0);  // once: the group, the plan, the staging buffers
  // The save and its polls take part in no collective of the world's: the
  // thread plans, exchanges and commits on a group of its own.
  const int64_t world_collectives = dist::world()->stats().total();
  const double stall = async.save((dir.path / "async").string(), 2, *model, &opt, extra, 0);
  CHECK(stall < 0.3);  // staging, not writing
  CHECK(async.pending());
  CHECK(async.pending_step() == 2);
  CHECK(async.poll().empty());  // nobody has written yet
  CHECK(dist::world()->stats().total() == world_collectives);
  train_steps(*model, opt, 1);  // the tensors change under the writer: it writes the staged copies
  const std::string written = async.wait();
  ::unsetenv("TESSERA_CHECKPOINT_WRITE_DELAY_MS");
  CHECK_FALSE(async.pending());
  CHECK(fs::path(written).filename() == "step-00000002");
  barrier();
  auto sync_files = files_of(dir.path / "sync"), async_files = files_of(dir.path / "async");
  CHECK(sync_files.size() == async_files.size());
  for (const auto& [name, bytes] : sync_files) {
    INFO(name);
    REQUIRE(async_files.count(name) == 1);
    CHECK(async_files[name] == bytes);
  }
  // It loads as the model was at step 2.
  auto fresh = sharded_gpt(c, 0);
  fsdp::load_checkpoint(written, *fresh, nullptr);
  auto loaded = fresh->state_dict();
  for (size_t i = 0; i < loaded.size(); ++i) CHECK(equal(local_tensor(loaded[i].second), kept[i]));

  // poll() commits on its own once every writer is done.
  ::setenv("TESSERA_CHECKPOINT_WRITE_DELAY_MS", "100", 1);
  async.save((dir.path / "async").string(), 3, *model, &opt, "{}", 0);
  ::unsetenv("TESSERA_CHECKPOINT_WRITE_DELAY_MS");
  std::string committed;
  int polls = 0;
  while (committed.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    committed = async.poll();
    ++polls;
    REQUIRE(polls < 1000);
  }
  CHECK(polls >= 2);
  CHECK(fs::path(committed).filename() == "step-00000003");
  CHECK(fs::path(fsdp::latest_checkpoint((dir.path / "async").string())).filename() == "step-00000003");
  CHECK(async.wait().empty());  // nothing pending any more
}

TEST_CASE("an asynchronous save that fails in the background is reported on every rank, nothing committed", "[checkpoint][async]") {
  SharedDir dir;
  auto c = small_gpt();
  auto model = sharded_gpt(c, 8);
  fsdp::AsyncCheckpointer async;
  async.save(dir.path.string(), 1, *model, nullptr, "{}", 0);
  CHECK(fs::path(async.wait()).filename() == "step-00000001");
  // A full disk on one rank (the last): the others wrote theirs, and still nothing is complete.
  if (dist::rank() == world() - 1) ::setenv("TESSERA_CHECKPOINT_FAIL_AT", "data", 1);
  async.save(dir.path.string(), 2, *model, nullptr, "{}", 0);
  ::unsetenv("TESSERA_CHECKPOINT_FAIL_AT");
  REQUIRE_THROWS_WITH(async.wait(), Contains("save_checkpoint failed on rank " + std::to_string(world() - 1)) &&
                                        Contains("No space left on device") &&
                                        Contains("the previous checkpoint is untouched"));
  CHECK_FALSE(async.pending());
  barrier();
  CHECK(fs::path(fsdp::latest_checkpoint(dir.path.string())).filename() == "step-00000001");
  CHECK_FALSE(fs::exists(dir.path / "step-00000002"));
  // The next save clears the leftovers and commits.
  async.save(dir.path.string(), 3, *model, nullptr, "{}", 0);
  CHECK(fs::path(async.wait()).filename() == "step-00000003");
  barrier();
  CHECK_FALSE(fs::exists(dir.path / "step-00000002.tmp"));
}
