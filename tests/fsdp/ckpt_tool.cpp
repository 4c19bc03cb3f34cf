// A small program for the multi-process checkpoint tests (checkpoint_test.sh):
// each subcommand runs under mpirun at some world size.
//
//   save   <dir> <reference.safetensors> [2d]  train 2 steps (on a 2x2 mesh with
//                                          2d), save model + optimizer, export the
//                                          full state as a reference
//   verify <dir> <reference.safetensors> [2d]  load at this world size (or a
//                                          2x2 mesh) and compare every shard
//   train  <dir> <steps> <save_at>         train, saving at step save_at; print losses
//   resume <dir> <steps> [save_at]         continue from the latest checkpoint
#include <cstdio>
#include <cstring>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "nn/models.h"
#include "nn/safetensors.h"

using namespace tessera;

namespace {

nn::TransformerConfig config() {
  nn::TransformerConfig c;
  c.vocab_size = 17;  // uneven rows at 2, 3, 4 ranks
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 12;
  return c;
}

struct Run {
  std::shared_ptr<nn::GPT> model;
  std::unique_ptr<optim::AdamW> opt;
};

Run build(bool two_d) {
  int w = dist::world_size();
  MeshPtr mesh = two_d ? init_device_mesh("cpu", {2, w / 2}, {"replicate", "shard"})
                       : init_device_mesh("cpu", {w}, {"dp"});
  Run r;
  r.model = nn::GPT::on_meta(config());
  for (auto& b : r.model->blocks) fsdp::fully_shard(*b, {.mesh = mesh});
  fsdp::fully_shard(*r.model, {.mesh = mesh});
  r.model->to_empty(Device::cpu());
  r.model->init_weights(11);
  r.opt = std::make_unique<optim::AdamW>(r.model->parameters(),
                                         optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
  return r;
}

// One step on a global batch of 12 sequences (the same data at any world size).
double step(Run& r, int64_t s) {
  int w = dist::world_size(), rank = dist::rank();
  Tensor x = randint({12, 8}, 0, 17, 1000 + static_cast<uint64_t>(s)),
         y = randint({12, 8}, 0, 17, 2000 + static_cast<uint64_t>(s));
  int64_t n = 12 / w;
  Tensor lx = ops::contiguous(ops::narrow(x, 0, rank * n, n)),
         ly = ops::contiguous(ops::narrow(y, 0, rank * n, n));
  Tensor loss = nn::cross_entropy((*r.model)(lx), ly);
  autograd::backward(loss);
  nn::clip_grad_norm_(r.model->parameters(), 1.0);
  r.opt->step();
  r.opt->zero_grad();
  Tensor l = ops::reshape(ops::to(loss, DType::F64), {1});
  dist::world()->all_reduce(l, {dist::ReduceOp::Avg})->wait();
  return l.item();
}

nn::StateDict everything(Run& r) {
  nn::StateDict all = r.model->state_dict();
  for (auto& [k, v] : r.opt->state_dict(r.model->named_parameters()))
    if (v.dim() > 0) all.emplace_back("optim." + k, v);
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    dist::init(argc, argv);
    std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "save" && argc >= 4) {
      Run r = build(argc > 4 && std::string(argv[4]) == "2d");
      step(r, 0);
      step(r, 1);
      fsdp::save_checkpoint(argv[2], 2, *r.model, r.opt.get(), R"({"note": "ckpt_tool"})", 2);
      // The reference: every tensor gathered one at a time and streamed into one file.
      nn::StateDict all = everything(r);
      std::vector<nn::SafetensorsEntry> entries;
      uint64_t off = 0;
      for (auto& [k, v] : all) {
        uint64_t bytes = static_cast<uint64_t>(v.numel()) * dtype_size(v.dtype());
        entries.push_back({k, v.dtype(), v.shape(), off, off + bytes});
        off += bytes;
      }
      std::vector<Tensor> gathered;
      fsdp::for_each_full_tensor(
          all, true, [&](const std::string&, const Tensor& t) { gathered.push_back(t); });
      if (dist::rank() == 0)
        nn::write_safetensors(argv[3], entries, [&](size_t i) { return gathered[i]; });
      return 0;
    }
    if (cmd == "verify" && argc >= 4) {
      bool two_d = argc > 4 && std::string(argv[4]) == "2d";
      Run r = build(two_d);
      auto md = fsdp::load_checkpoint(argv[2], *r.model, r.opt.get());
      nn::SafetensorsFile ref(argv[3]);
      int64_t bad = 0;
      for (auto& [k, v] : everything(r)) {
        Tensor full = ref.read(k);
        Tensor expect = is_dtensor(v)
                            ? local_tensor(distribute_tensor_local(full, dtensor_spec(v).mesh,
                                                                   dtensor_spec(v).placements))
                            : full;
        Tensor got = is_dtensor(v) ? local_tensor(v) : v;
        if (got.to_vector<double>() != expect.to_vector<double>()) {
          std::fprintf(stderr, "rank %d: %s differs\n", dist::rank(), k.c_str());
          ++bad;
        }
      }
      if (md.step != 2) ++bad;
      if (dist::rank() == 0)
        std::printf("verified %zu tensors, step %lld, mismatches %lld\n", ref.entries().size(),
                    static_cast<long long>(md.step), static_cast<long long>(bad));
      return bad == 0 ? 0 : 1;
    }
    if ((cmd == "train" && argc >= 5) || (cmd == "resume" && argc >= 4)) {
      Run r = build(false);
      int64_t steps = std::atoll(argv[3]), start = 0,
              save_at = argc >= 5 ? std::atoll(argv[4]) : -1;
      if (cmd == "resume") {
        std::string dir = fsdp::latest_checkpoint(argv[2]);
        if (dir.empty()) throw Error("no checkpoint to resume from");
        start = fsdp::load_checkpoint(dir, *r.model, r.opt.get()).step;
      }
      for (int64_t s = start; s < steps; ++s) {
        double loss = step(r, s);
        if (dist::rank() == 0)
          std::printf("step %lld loss %.17g\n", static_cast<long long>(s), loss);
        if (s + 1 == save_at) fsdp::save_checkpoint(argv[2], s + 1, *r.model, r.opt.get());
      }
      return 0;
    }
    std::fprintf(stderr, "usage: ckpt_tool save|verify|train|resume ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_tool: rank %d: %s\n", dist::rank(), e.what());
    return 1;
  }
}
