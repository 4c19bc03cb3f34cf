// Context parallelism's load balance, measured: a Llama of a few blocks
// trained on long sequences over every rank as one cp group (FSDP over the
// same ranks), each rotate method with head-tail chunks and with the plain
// contiguous split. Per layout, after a warm-up step, the mean over `steps`
// traced steps of each rank's attention time (the "context parallel
// attention" lane: the blocks of the one-process kernel this rank computed,
// forward and backward), the slowest rank's over the fastest's, and the step
// time. Under the causal mask the contiguous split gives the last rank
// (2cp - 1) times the first's blocks; head-tail gives every rank the same.
//
//   mpirun -np 4 --bind-to core -x OMP_NUM_THREADS=1 build/benchmarks/bench_context_parallel [seq] [n_embd] [steps] [trace folder]
//
// Needs one core per rank to mean anything (ranks sharing a core slow each
// other down whatever their share). A fourth argument writes the last step
// of each layout as <folder>/<method>-<layout>.json (tools/trace_png.py draws it).
#include <tessera/tessera.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

using namespace tessera;

int main(int argc, char** argv) {
  dist::init(argc, argv);
  auto world = dist::world();
  const int cp = world->size(), me = world->rank();
  const int64_t seq = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t width = argc > 2 ? std::atoll(argv[2]) : 128;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 3;
  const std::string trace_dir = argc > 4 ? argv[4] : "";
  if (!trace_dir.empty() && me == 0) std::filesystem::create_directories(trace_dir);
  nn::TransformerConfig cfg;
  cfg.arch = "llama";
  cfg.vocab_size = 256;
  cfg.block_size = seq;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_kv_head = 2;
  cfg.n_embd = width;
  cfg.bias = false;
  cfg.tie_embeddings = false;
  if (me == 0) {
    std::printf("context parallel load balance: CP %d, Llama %lld blocks d=%lld (4 heads, 2 K/V heads), 1 sequence of "
                "%lld tokens; mean of %d traced steps after one warm-up\n",
                cp, static_cast<long long>(cfg.n_layer), static_cast<long long>(width), static_cast<long long>(seq),
                steps);
    std::printf("%-10s %-11s %40s %14s %10s\n", "method", "layout", "attention ms per rank (rank 0 ..)",
                "slowest/fastest", "step ms");
  }
  const trace::Lane attention = trace::register_lane("context parallel attention");
  for (const std::string method : {"allgather", "ring"})
    for (bool lb : {true, false}) {
      train::ParallelismOptions o{.cp = cp, .cp_rotate_method = method, .cp_load_balance = lb};
      MeshPtr mesh = train::make_mesh(o);
      auto model = nn::make_model(cfg, Device::meta());
      train::parallelize(*model, mesh, o);
      model->to_empty(Device::cpu());
      model->init_weights(1);
      std::vector<double> mine;  // this rank's attention ms per traced step
      double step_ms = 0;
      for (int k = 0; k <= steps; ++k) {
        Tensor x = randint({1, seq}, 0, cfg.vocab_size, 10 + static_cast<uint64_t>(k));
        Tensor y = randint({1, seq}, 0, cfg.vocab_size, 20 + static_cast<uint64_t>(k));
        world->barrier()->wait();
        trace::take();
        trace::enable(k > 0);
        const double t0 = trace::now_us();
        train::forward_backward(*model, 1, [&](int64_t) { return std::pair{x, y}; });
        world->barrier()->wait();
        const double t1 = trace::now_us();
        trace::enable(false);
        std::vector<trace::Span> spans = trace::take();
        model->zero_grad();
        if (k == 0) continue;
        mine.push_back(trace::covered_us(spans, attention) / 1e3);
        step_ms += (t1 - t0) / 1e3 / steps;
        if (k == steps && !trace_dir.empty())
          trace::write_chrome_trace(trace_dir + "/" + method + "-" + (lb ? "head-tail" : "contiguous") + ".json", spans,
                                    fmt::format("CP {} {} {}: one step of a Llama at {} tokens", cp, method,
                                                lb ? "head-tail" : "contiguous", seq));
      }
      double mean = 0;
      for (double v : mine) mean += v / static_cast<double>(mine.size());
      Tensor all = empty({cp}, DType::F64);
      world->all_gather_into_tensor(all, full({1}, mean, DType::F64))->wait();
      const std::vector<double> per_rank = all.to_vector<double>();
      if (me == 0) {
        std::string ms;
        for (double v : per_rank) ms += fmt::format("{}{:.1f}", ms.empty() ? "" : " ", v);
        const auto [lo, hi] = std::minmax_element(per_rank.begin(), per_rank.end());
        std::printf("%-10s %-11s %40s %14.2f %10.1f\n", method.c_str(), lb ? "head-tail" : "contiguous", ms.c_str(),
                    *hi / *lo, step_ms);
      }
    }
  dist::finalize();
  return 0;
}
