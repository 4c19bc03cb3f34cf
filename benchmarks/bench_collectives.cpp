// All-gather, reduce-scatter and all-reduce through Tessera's process group
// vs the same MPI call made directly, 4 KiB .. 64 MiB, interleaved in one run.
// Prints nccl-tests' algorithm and bus bandwidth: size = bytes of the full
// (gathered / pre-scatter / reduced) buffer, algbw = size / time, busbw =
// algbw * (n - 1) / n (all-reduce: 2 (n - 1) / n).
//   mpirun -np 4 build/benchmarks/bench_collectives [max_mib] [--save]
// --save fits t = alpha + beta x size to Tessera's times, per collective, and
// writes the fits for this group size where tessera-plan --time reads them
// (tools/step_time.h: collectives-<n>.tsv in its cache directory).
// In thread progress mode the direct MPI calls run on the communication
// thread (the only thread allowed to call MPI); in poll mode on the caller.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <map>
#include <vector>

#include "runtime/distributed.h"
#include "runtime/mpi/engine.h"
#include "runtime/random.h"
#include "tools/step_time.h"

using namespace tessera;

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void raw(const std::function<void()>& fn) {
  auto& engine = dist::detail::Engine::get();
  if (engine.thread_mode()) engine.run_sync(fn);
  else fn();
}
}  // namespace

int main(int argc, char** argv) {
  dist::init(argc, argv);
  auto pg = dist::world();
  int W = pg->size(), r = pg->rank();
  double max_mib = 64;
  bool save = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--save") == 0) save = true;
    else max_mib = std::atof(argv[i]);
  }
  std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> points;  // kind -> (bytes, s)
  MPI_Comm comm = MPI_COMM_NULL;
  raw([&] { MPI_Comm_dup(MPI_COMM_WORLD, &comm); });
  if (r == 0)
    std::printf("ranks %d, progress %s\n%-15s %10s %12s %12s %12s %12s %12s %7s\n", W,
                dist::progress_mode().c_str(), "collective", "size", "tessera us", "mpi us", "algbw GB/s",
                "busbw GB/s", "mpi busbw", "ratio");
  for (const char* kind : {"all_gather", "reduce_scatter", "all_reduce"}) {
    const bool reduce = std::strcmp(kind, "all_reduce") == 0;
    for (double bytes = 4096; bytes <= max_mib * 1048576.0 + 1; bytes *= 4) {
      int64_t total = static_cast<int64_t>(bytes) / 4 / W * W;  // f32 elements of the full buffer
      int64_t shard = total / W;
      Tensor full = randn({total}, 1), part = randn({shard}, 2);
      int reps = std::clamp(static_cast<int>(2e8 / bytes), 3, 2000);
      std::vector<double> ours, direct;
      for (int round = 0; round < 5; ++round) {
        pg->barrier()->wait();
        double t0 = now();
        for (int i = 0; i < reps; ++i) {
          if (reduce) pg->all_reduce(full)->wait();
          else if (kind[0] == 'a') pg->all_gather_into_tensor(full, part)->wait();
          else pg->reduce_scatter_tensor(part, full)->wait();
        }
        ours.push_back((now() - t0) / reps);
        pg->barrier()->wait();
        t0 = now();
        raw([&] {
          for (int i = 0; i < reps; ++i) {
            if (reduce)
              MPI_Allreduce(MPI_IN_PLACE, full.data<float>(), static_cast<int>(total), MPI_FLOAT, MPI_SUM, comm);
            else if (kind[0] == 'a')
              MPI_Allgather(part.data<float>(), static_cast<int>(shard), MPI_FLOAT, full.data<float>(),
                            static_cast<int>(shard), MPI_FLOAT, comm);
            else
              MPI_Reduce_scatter_block(full.data<float>(), part.data<float>(), static_cast<int>(shard), MPI_FLOAT,
                                       MPI_SUM, comm);
          }
        });
        direct.push_back((now() - t0) / reps);
      }
      double to = median(ours), td = median(direct);
      double size = static_cast<double>(total) * 4;
      double factor = (reduce ? 2.0 : 1.0) * (W > 1 ? static_cast<double>(W - 1) / W : 1.0);
      points[kind].first.push_back(size);
      points[kind].second.push_back(to);
      if (r == 0)
        std::printf("%-15s %9.0fK %12.1f %12.1f %12.2f %12.2f %12.2f %7.3f\n", kind, size / 1024, to * 1e6,
                    td * 1e6, size / to / 1e9, size / to * factor / 1e9, size / td * factor / 1e9, td / to);
    }
  }
  raw([&] { MPI_Comm_free(&comm); });
  if (save && r == 0 && W > 1) {
    const std::string dir = tools::cache_dir(), path = dir + "/collectives-" + std::to_string(W) + ".tsv";
    std::filesystem::create_directories(dir);
    std::ofstream out(path, std::ios::trunc);
    out << "# kind ranks alpha_s beta_s_per_byte: t = alpha + beta x bytes of the full buffer (bench_collectives)\n";
    for (const auto& [kind, xy] : points) {
      tools::CollectiveFit f = tools::fit_alpha_beta(xy.first, xy.second);
      out << kind << " " << W << " " << f.alpha_s << " " << f.beta_s_per_byte << "\n";
      std::printf("fit %-14s alpha %.1f us, beta %.3f us/MiB (%.2f GB/s)\n", kind.c_str(), f.alpha_s * 1e6,
                  f.beta_s_per_byte * 1048576e6, f.beta_s_per_byte > 0 ? 1e-9 / f.beta_s_per_byte : 0.0);
    }
    std::printf("saved %s\n", path.c_str());
  }
  return 0;
}
