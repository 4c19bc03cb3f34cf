// tessera-plan: one rank's memory, communication and compute for a
// tessera-train configuration at a given number of ranks, predicted without
// running it (tools/plan.h).
//
//   tessera-plan --ranks 1,2,4 --preset tiny --model.n_layer 12
//
// Takes tessera-train's arguments (--config, --preset, --section.key value)
// plus --ranks (a comma-separated list of world sizes, default 1), --rank
// (the rank to plan, default 0), and for the step time (tools/step_time.h)
// --time (on this machine: measures the step's kernels once, cached, and uses
// the collective fits of bench_collectives --save), --hardware FILE (on
// described hardware, hardware/*.toml) and --ranks-per-node N (default: all
// on one node).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "runtime/check.h"
#include "runtime/kernel_log.h"
#include "runtime/parallel.h"
#include "tools/config.h"
#include "tools/plan.h"
#include "tools/step_time.h"

using namespace tessera;

namespace {

int64_t parse_count(const std::string& flag, const std::string& text, int64_t lowest) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TS_CHECK(used == text.size() && !text.empty() && v >= lowest && v <= (1 << 20),
           "{}: expected an integer from {} to {}, got '{}'", flag, lowest, 1 << 20, text);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<int> worlds = {1};
    int rank = 0, per_node = 0;
    bool time = false;
    std::string hardware;
    std::vector<char*> rest = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--time") {
        time = true;
        continue;
      }
      std::string flag = a.substr(0, a.find('='));
      if (flag != "--ranks" && flag != "--rank" && flag != "--hardware" && flag != "--ranks-per-node" &&
          flag != "--bf16-products") {
        rest.push_back(argv[i]);
        continue;
      }
      std::string value;
      if (a.find('=') != std::string::npos) {
        value = a.substr(a.find('=') + 1);
      } else {
        TS_CHECK(i + 1 < argc, "{} needs a value", a);
        value = argv[++i];
      }
      if (flag == "--ranks") {
        worlds.clear();
        for (const auto& item : tools::split_list(value))
          worlds.push_back(static_cast<int>(parse_count("--ranks", item, 1)));
        TS_CHECK(!worlds.empty(), "--ranks: expected a list of world sizes such as 1,2,4, got '{}'", value);
      } else if (flag == "--rank") {
        rank = static_cast<int>(parse_count("--rank", value, 0));
      } else if (flag == "--ranks-per-node") {
        per_node = static_cast<int>(parse_count("--ranks-per-node", value, 1));
      } else if (flag == "--bf16-products") {
        TS_CHECK(value == "cpu" || value == "native" || value == "amx" || value == "own" || value == "f32",
                 "--bf16-products: expected cpu (as this CPU runs them), native, amx, own or f32, got '{}'", value);
        meta_kernels::set_bf16_products(value == "native" ? meta_kernels::Bf16Products::Native
                                        : value == "amx"  ? meta_kernels::Bf16Products::Amx
                                        : value == "own"  ? meta_kernels::Bf16Products::Own
                                        : value == "f32"  ? meta_kernels::Bf16Products::F32Copies
                                                          : meta_kernels::Bf16Products::ThisCpu);
      } else {
        hardware = value;
      }
    }
    tools::TrainConfig cfg;
    int rest_argc = static_cast<int>(rest.size());
    if (!tools::parse_args(cfg, rest_argc, rest.data(), "tessera-plan")) {
      std::printf(
          "\ntessera-plan's own options:\n"
          "  --ranks N[,N...]   world sizes to plan (default 1)\n"
          "  --rank R           the rank to plan (default 0)\n"
          "  --time             predict the step time on this machine (measures each kernel once, cached;\n"
          "                     collectives from `mpirun -np N bench_collectives 16 --save`)\n"
          "  --hardware FILE    plan for described hardware (hardware/*.toml in the source tree): memory with\n"
          "                     native bf16 and NCCL's buffers, step time from a roofline (instead of --time)\n"
          "  --ranks-per-node N ranks sharing a node (default: all of them)\n"
          "  --bf16-products cpu|native|amx|own|f32\n"
          "                     bf16 matrix products planned as this CPU runs them (cpu, the default: bf16\n"
          "                     where oneDNN has AVX512-BF16 or AMX kernels, else on Tessera's f32 kernel,\n"
          "                     else on f32 copies), or as another CPU would: native (oneDNN's AVX512-BF16\n"
          "                     kernels), amx (AMX tiles: Tessera's kernel packs its operands), own (an\n"
          "                     AVX2 CPU: Tessera's f32 kernel packs them widened, in the geometry of this\n"
          "                     CPU's copy of it where it has one) or f32 (the f32 copies add to a bf16\n"
          "                     run's peak)\n");
      return 0;
    }
    TS_CHECK(meta_kernels::bf16_products() == meta_kernels::Bf16Products::ThisCpu || (hardware.empty() && !time),
             "--bf16-products plans another CPU's memory; it does not go with {} (which {})",
             time ? "--time" : "--hardware", time ? "times this CPU's kernels" : "plans a GPU: bf16 products in bf16");
    const tools::Hardware hw = hardware.empty() ? tools::Hardware{} : tools::load_hardware(hardware);
    std::optional<tools::PlanAsGpu> as_gpu;
    if (!hardware.empty()) as_gpu.emplace();
    for (int world : worlds) {
      const bool timed = time || !hardware.empty();
      // The ranks on one node, and their threads as tessera-train sets them
      // (the CPU's attention takes scratch per thread).
      const int here = per_node > 0 ? std::min(per_node, world) : world;
      const int threads = tools::threads_per_rank(here);
      if (hardware.empty()) set_num_threads(threads);
      tools::Plan plan = tools::plan_run(cfg, world, rank, /*log_step=*/timed);
      std::fputs(tools::format_plan(plan, cfg).c_str(), stdout);
      const bool pipelined = cfg.parallelism.pipeline_parallel_degree > 1;
      if (pipelined) std::fputs(tools::format_stage_plans(tools::plan_stage_positions(cfg, world)).c_str(), stdout);
      if (timed && pipelined) {
        // One rank's kernels and collectives do not make a pipeline's step:
        // its stages wait on each other (the bubble above).
        std::printf("step time: not modelled for a pipeline yet (the schedule's bubble is above)\n");
      } else if (timed) {
        const auto& log = *plan.step_log;
        std::vector<double> seconds;
        tools::CommModel comm;
        bool overlap = true;
        std::string how;
        if (!hardware.empty()) {
          seconds = tools::roofline_kernels(log, hw);
          comm = tools::comm_model(hw, log.collectives);
          how = fmt::format("{}, roofline at the file's efficiencies", hw.name);
          std::printf("device memory %.1f GiB: the planned peak %s\n", hw.memory_bytes / 1073741824.0,
                      static_cast<double>(plan.peak) <= hw.memory_bytes ? "fits" : "does NOT fit");
        } else {
          const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
          if (world > 1) comm = tools::load_comm_fits(tools::cache_dir());  // before measuring: it may throw
          // Kept to cores of their own as tessera-train keeps its ranks (job.bind_cores).
          const bool pinned = cfg.job.bind_cores && !tools::rank_cpus(0, here, threads).empty();
          const std::string cache = tools::kernel_cache_path(tools::cache_dir(), threads, here, pinned);
          tools::Calibration cal = tools::measure_kernels(log, threads, here, cache, pinned);
          std::fprintf(stderr,
                       "tessera-plan: %lld distinct kernel(s) measured, %lld from %s; the step replayed takes "
                       "%.3fx their sum\n",
                       static_cast<long long>(cal.measured), static_cast<long long>(cal.cached), cache.c_str(),
                       cal.replay_scale);
          seconds = std::move(cal.seconds);
          // With every core computing, the engine thread that moves a
          // collective runs only while its rank waits: no overlap.
          overlap = here * threads < cores;
          how = fmt::format("this machine, {} rank(s) of {} thread(s) on {} cores{}", here, threads, cores,
                            world > 1 && !overlap ? ", no core left to overlap communication" : "");
        }
        const tools::StepTime t = tools::simulate_step(log, seconds, comm, 1.0, overlap);
        std::fputs(tools::format_step_time(t, how).c_str(), stdout);
        // MFU counts the model's FLOPs (forward and backward, not the recompute)
        // against the peak of every rank: the file's, metrics.peak_tflops, or
        // this machine's measured as tessera-train measures it, per node.
        const double flops = (plan.flops_forward + plan.flops_backward) * world;
        const bool bf16 = cfg.mixed_precision.param_dtype != "float32";
        double peak = 0;
        std::string source;
        if (!hardware.empty()) {
          peak = world * hw.peak_flops.at(bf16 ? "bfloat16" : "float32");
          source = "the file's peak x ranks";
        } else if (cfg.metrics.peak_tflops > 0) {
          peak = cfg.metrics.peak_tflops * 1e12;
          source = "metrics.peak_tflops";
        } else {  // as tessera-train measures it, on each node
          const int nodes = (world + here - 1) / here;
          std::string unit;
          peak = nodes * tools::node_peak_flops(cfg.mixed_precision.param_dtype, here, threads, &unit);
          source = fmt::format("{} on this machine{}", unit, nodes > 1 ? fmt::format(", x {} nodes", nodes) : "");
        }
        std::printf("  MFU at that step time: %.1f%% of %.4g TFLOP/s (%s)\n", 100 * flops / t.step_s / peak,
                    peak / 1e12, source.c_str());
      }
      std::fputs("\n", stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-plan: error: %s\n", e.what());
    return 2;
  }
}
