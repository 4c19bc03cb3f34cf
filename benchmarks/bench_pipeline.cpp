// The pipeline's bubble, measured against each schedule's formula: a GPT of
// equal blocks cut into one stage per rank (two per rank for interleaved),
// trained for a few steps of each schedule and micro-batch count; per step,
// each rank's idle share of the step (1 - the time it spent in its F and B
// (or I and W) actions, pp::Pipeline::last_step_time, over the step's span from a
// barrier before it to one after), the mean over ranks and steps beside the
// formula.
//
//   mpirun -np 2 build/benchmarks/bench_pipeline [n_embd] [blocks per rank] [steps] [trace folder]
//
// Needs one core per rank to mean anything (ranks sharing a core wait for
// each other's compute, which is not a pipeline's bubble).
#include <tessera/tessera.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

using namespace tessera;

int main(int argc, char** argv) {
  dist::init(argc, argv);
  auto group = dist::world();
  const int p = group->size();
  const int64_t width = argc > 1 ? std::atoll(argv[1]) : 256;
  const int64_t per_stage = argc > 2 ? std::atoll(argv[2]) : 2;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 4;
  // A fifth argument: a folder for a trace of each schedule's last step at
  // the smaller m (<folder>/<schedule>.json; tools/trace_png.py draws it).
  const std::string trace_dir = argc > 4 ? argv[4] : "";
  if (!trace_dir.empty() && group->rank() == 0) std::filesystem::create_directories(trace_dir);
  if (group->rank() == 0)
    std::printf("pipeline bubble: %d rank(s), GPT d=%lld, %lld block(s) per rank, 4 sequences of 128 tokens "
                "per micro-batch, mean of %d steps after one warm-up\n",
                p, static_cast<long long>(width), static_cast<long long>(per_stage), steps);
  if (group->rank() == 0)
    std::printf("%-18s %4s %12s %12s %10s\n", "schedule", "m", "measured", "formula", "step ms");
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}) {
    const int v = schedule == "interleaved_1f1b" ? 2 : 1;
    for (int m : {2 * p, 4 * p}) {
      nn::TransformerConfig cfg;
      cfg.vocab_size = 256;
      cfg.block_size = 128;
      cfg.n_layer = per_stage * p * v;  // equal blocks, per_stage on each rank
      cfg.n_head = 4;
      cfg.n_embd = width;
      cfg.tie_embeddings = false;
      pp::Pipeline pipe(group, cfg, {.schedule = schedule, .microbatches = m, .stages_per_rank = v});
      pipe.materialize(Device::cpu(), 1);
      optim::AdamW opt(pipe.parameters(), {.lr = 1e-3});
      double bubble = 0, ms = 0;
      for (int k = 0; k <= steps; ++k) {
        Tensor idx = randint({4 * m, 128}, 0, 256, 10 + static_cast<uint64_t>(k));
        Tensor y = randint({4 * m, 128}, 0, 256, 20 + static_cast<uint64_t>(k));
        // The step's span is every rank's: from a barrier before it to one
        // after it (a rank's own span would leave out the time it idles
        // while the others finish).
        const bool traced = !trace_dir.empty() && k == steps && m == 2 * p;
        group->barrier()->wait();
        if (traced) trace::take(), trace::enable(true);
        const double t0 = trace::now_us();
        pipe.step(idx, y);
        group->barrier()->wait();
        const double span_us = trace::now_us() - t0;
        if (traced) {
          trace::enable(false);
          trace::write_chrome_trace(trace_dir + "/" + schedule + ".json", trace::take(),
                                    fmt::format("{}: {} ranks, {} micro-batches, GPT d={}", schedule, p, m, width));
        }
        opt.step();
        opt.zero_grad();
        if (k == 0) continue;  // warm-up
        // Every rank's idle share and step time, summed over ranks.
        Tensor t = from_vector(std::vector<double>{1.0 - pipe.last_step_time().busy_us / span_us, span_us / 1e3}, {2});
        if (p > 1) group->all_reduce(t)->wait();
        bubble += t.to_vector<double>()[0] / p;
        ms += t.to_vector<double>()[1] / p;
      }
      // Idle over the span with a backward twice a forward (pp::simulate):
      // (p-1)/(m+p-1) for GPipe and 1F1B; interleaving divides the idle
      // time by v: (p-1)/(v m + p - 1); ZB-H1 leaves a third of 1F1B's idle
      // time: (p-1)/(3m + p - 1).
      const double formula = pp::simulate(pipe.schedule()).bubble();
      if (group->rank() == 0)
        std::printf("%-18s %4d %11.1f%% %11.1f%% %10.1f\n", schedule.c_str(), m, 100 * bubble / steps,
                    100 * formula, ms / steps);
    }
  }
  return 0;
}
