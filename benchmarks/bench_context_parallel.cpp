// Context parallelism's load balance, measured: a Llama of a few blocks
// trained on long sequences over every rank as one cp group (FSDP over the
// same ranks), each rotate method with head-tail chunks and with the plain
// contiguous split. Per layout, after a warm-up step, over `steps` traced
// steps, each rank's attention work (cp::ContextParallel::work): the score
// entries its blocks cover (exact), the CPU time of its attention kernels
// (the calling thread's: what the work costs, without time descheduled, so
// it holds with more ranks than cores) and the wall time of its spans on the
// "context parallel attention" trace lane (meaningful with a core per
// rank); the slowest rank's over the fastest's, and the step time. Under the
// causal mask the contiguous split gives rank r (2r + 1) times the first
// rank's blocks; head-tail gives every rank the same.
//
//   mpirun -np 4 --bind-to core -x OMP_NUM_THREADS=1 build/benchmarks/bench_context_parallel [seq]
//   [n_embd] [steps] [trace folder]
//
// A fourth argument writes the last step of each layout as
// <folder>/<method>-<layout>.json (tools/trace_png.py draws it).
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
    std::printf(
        "context parallel load balance: CP %d, Llama %lld blocks d=%lld (4 heads, 2 K/V heads), 1 "
        "sequence of "
        "%lld tokens; mean of %d traced steps after one warm-up\n",
        cp, static_cast<long long>(cfg.n_layer), static_cast<long long>(width),
        static_cast<long long>(seq), steps);
    std::printf("%-10s %-11s %14s %34s %9s %34s %9s %9s\n", "method", "layout", "scores max/min",
                "attention CPU ms per rank", "max/min", "attention wall ms per rank", "max/min",
                "step ms");
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
      auto slices = std::dynamic_pointer_cast<cp::ContextParallel>(model->sequence_shard());
      double wall_ms = 0, cpu_ms = 0, scores = 0, step_ms = 0;  // this rank's, per traced step
      for (int k = 0; k <= steps; ++k) {
        Tensor x = randint({1, seq}, 0, cfg.vocab_size, 10 + static_cast<uint64_t>(k));
        Tensor y = randint({1, seq}, 0, cfg.vocab_size, 20 + static_cast<uint64_t>(k));
        world->barrier()->wait();
        trace::take();
        trace::enable(k > 0);
        slices->reset_work();
        const double t0 = trace::now_us();
        train::forward_backward(*model, 1, [&](int64_t) { return std::pair{x, y}; });
        world->barrier()->wait();
        const double t1 = trace::now_us();
        trace::enable(false);
        std::vector<trace::Span> spans = trace::take();
        model->zero_grad();
        if (k == 0) continue;
        wall_ms += trace::covered_us(spans, attention) / 1e3 / steps;
        cpu_ms += slices->work().cpu_seconds * 1e3 / steps;
        scores += slices->work().scores / steps;
        step_ms += (t1 - t0) / 1e3 / steps;
        if (k == steps && !trace_dir.empty())
          trace::write_chrome_trace(
              trace_dir + "/" + method + "-" + (lb ? "head-tail" : "contiguous") + ".json", spans,
              fmt::format("CP {} {} {}: one step of a Llama at {} tokens", cp, method,
                          lb ? "head-tail" : "contiguous", seq));
      }
      // Every rank's figures on rank 0: [scores, cpu, wall] per rank.
      Tensor all = empty({3 * cp}, DType::F64);
      world
          ->all_gather_into_tensor(all,
                                   from_vector(std::vector<double>{scores, cpu_ms, wall_ms}, {3}))
          ->wait();
      const std::vector<double> v = all.to_vector<double>();
      if (me == 0) {
        auto column = [&](int i) {
          std::vector<double> c;
          for (int r = 0; r < cp; ++r) c.push_back(v[static_cast<size_t>(3 * r + i)]);
          return c;
        };
        auto ratio = [](const std::vector<double>& c) {
          const auto [lo, hi] = std::minmax_element(c.begin(), c.end());
          return *hi / *lo;
        };
        auto list = [](const std::vector<double>& c) {
          std::string out;
          for (double x : c) out += fmt::format("{}{:.1f}", out.empty() ? "" : " ", x);
          return out;
        };
        std::printf("%-10s %-11s %14.2f %34s %9.2f %34s %9.2f %9.1f\n", method.c_str(),
                    lb ? "head-tail" : "contiguous", ratio(column(0)), list(column(1)).c_str(),
                    ratio(column(1)), list(column(2)).c_str(), ratio(column(2)), step_ms);
      }
    }
  dist::finalize();
  return 0;
}
