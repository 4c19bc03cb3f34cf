// FSDP2 training step on the GPT benchmark model (4 layers, d=256, 4 heads,
// seq 128, vocab 256, AdamW), global batch 8 split over the ranks, in one run:
//   fsdp           fully_shard on every block and the root, prefetch on (default)
//   fsdp-noprefetch  the same with implicit forward / default backward prefetch off
//   ddp            every rank holds the whole model; after backward one flat
//                  all-reduce (average) of every gradient (DDP-style baseline)
// For each: median step time, tokens/s (global), peak allocator bytes (max
// over ranks), model state per rank (parameters + gradients + AdamW moments),
// and exposed communication (time spent waiting on collectives, from a trace).
//   mpirun -np 4 -x OMP_NUM_THREADS=1 build/benchmarks/bench_fsdp [steps]
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "nn/models.h"
#include "nn/optim.h"
#include "runtime/allocator.h"
#include "runtime/trace.h"

using namespace tessera;

namespace {

nn::TransformerConfig bench_config() {
  nn::TransformerConfig c;
  c.vocab_size = 256;
  c.block_size = 128;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_embd = 256;
  return c;
}

double max_over_ranks(double v) {
  Tensor t = full({1}, v, DType::F64);
  dist::world()->all_reduce(t, {dist::ReduceOp::Max})->wait();
  return t.item();
}

int64_t state_bytes(const TensorList& params, optim::AdamW& opt) {
  int64_t b = 0;
  auto local = [](const Tensor& t) { return is_dtensor(t) ? local_tensor(t) : t; };
  for (size_t j = 0; j < params.size(); ++j) {
    const Tensor& p = params[j];
    b += static_cast<int64_t>(local(p).nbytes());
    if (p.grad().defined()) b += static_cast<int64_t>(local(p.grad()).nbytes());
    auto& s = opt.state(0, j);
    if (s.exp_avg.defined()) b += 2 * static_cast<int64_t>(local(s.exp_avg).nbytes());
  }
  return b;
}

struct Result {
  double step_ms, tokens_per_s, peak_mib, state_mib, exposed_pct;
};

Result run(const std::string& mode, int steps) {
  auto cfg = bench_config();
  int w = dist::world_size(), r = dist::rank();
  int64_t global_batch = 8, local_batch = global_batch / w, seq = 128;
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});
  std::shared_ptr<nn::GPT> model;
  bool fsdp_mode = mode != "ddp";
  if (fsdp_mode) {
    model = nn::GPT::on_meta(cfg);
    for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = mesh});
    fsdp::fully_shard(*model, {.mesh = mesh});
    model->to_empty(Device::cpu());
    model->init_weights(1);
  } else {
    model = std::make_shared<nn::GPT>(cfg);
    model->init_weights(1);
  }
  TensorList params = model->parameters();
  optim::AdamW opt(params, {.lr = 3e-4, .weight_decay = 0.1});
  std::vector<double> times;
  double exposed = 0, traced_ms = 0;
  const int traced_steps = 5;  // the exposed share is averaged over these
  reset_peak_memory_stats();
  for (int s = 0; s < steps + 2 + traced_steps; ++s) {
    Tensor x = randint({local_batch, seq}, 0, 256, static_cast<uint64_t>(s * 64 + r));
    Tensor y = randint({local_batch, seq}, 0, 256, static_cast<uint64_t>(s * 64 + r + 32));
    bool traced = s >= steps + 2;
    if (traced) {
      trace::take();
      trace::enable(true);
    }
    dist::world()->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    if (s == 2 && mode == "fsdp-noprefetch") fsdp::set_prefetch(*model, false);
    Tensor loss = nn::cross_entropy((*model)(x), y);
    autograd::backward(loss);
    if (!fsdp_mode && w > 1) {
      // DDP-style: one flat all-reduce (average) of every gradient.
      int64_t n = 0;
      for (auto& p : params) n += p.numel();
      Tensor flat = empty({n});
      int64_t off = 0;
      for (auto& p : params) {
        Tensor dst = ops::narrow(flat, 0, off, p.numel());
        ops::copy_(dst, ops::reshape(p.grad(), {p.numel()}));
        off += p.numel();
      }
      dist::world()->all_reduce(flat, {dist::ReduceOp::Avg})->wait();
      off = 0;
      for (auto& p : params) {
        Tensor g = p.grad();
        ops::copy_(g, ops::reshape(ops::narrow(flat, 0, off, p.numel()), p.shape()));
        off += p.numel();
      }
    }
    nn::clip_grad_norm_(params, 1.0);
    opt.step();
    opt.zero_grad();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (traced) {
      trace::enable(false);
      exposed += trace::summarize(trace::take()).exposed_us / 1000.0;
      traced_ms += ms;
    } else if (s >= 2) {
      times.push_back(ms);
    }
  }
  {  // one more backward so gradients exist for the state count
    Tensor x = randint({local_batch, seq}, 0, 256, 999), y = randint({local_batch, seq}, 0, 256, 998);
    autograd::backward(nn::cross_entropy((*model)(x), y));
  }
  std::sort(times.begin(), times.end());
  double step = max_over_ranks(times[times.size() / 2]);
  Result res;
  res.step_ms = step;
  res.tokens_per_s = static_cast<double>(global_batch * seq) / step * 1000.0;
  res.peak_mib = max_over_ranks(static_cast<double>(memory_stats().peak_allocated_bytes)) / 1048576.0;
  res.state_mib = max_over_ranks(static_cast<double>(state_bytes(params, opt))) / 1048576.0;
  res.exposed_pct = 100.0 * max_over_ranks(exposed / traced_ms);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  dist::init(argc, argv);
  int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  if (dist::rank() == 0)
    std::printf("ranks %d (progress %s), GPT 4x256, global batch 8 x 128\n%-16s %10s %10s %12s %14s %10s\n",
                dist::world_size(), dist::progress_mode().c_str(), "mode", "step ms", "tokens/s", "peak MiB",
                "state MiB/rank", "exposed %");
  for (const char* mode : {"ddp", "fsdp", "fsdp-noprefetch"}) {
    Result r = run(mode, steps);
    if (dist::rank() == 0)
      std::printf("%-16s %10.1f %10.0f %12.1f %14.2f %10.1f\n", mode, r.step_ms, r.tokens_per_s, r.peak_mib,
                  r.state_mib, r.exposed_pct);
  }
  return 0;
}
