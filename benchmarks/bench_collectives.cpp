// All-gather and reduce-scatter through Tessera's process group vs the same
// MPI call made directly, 4 KiB .. 64 MiB, interleaved in one run. Prints
// nccl-tests' algorithm and bus bandwidth: size = bytes of the full (gathered
// / pre-scatter) buffer, algbw = size / time, busbw = algbw * (n - 1) / n.
//   mpirun -np 4 build/benchmarks/bench_collectives [max_mib]
// In thread progress mode the direct MPI calls run on the communication
// thread (the only thread allowed to call MPI); in poll mode on the caller.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "runtime/distributed.h"
#include "runtime/mpi/engine.h"
#include "runtime/random.h"

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
  double max_mib = argc > 1 ? std::atof(argv[1]) : 64;
  MPI_Comm comm = MPI_COMM_NULL;
  raw([&] { MPI_Comm_dup(MPI_COMM_WORLD, &comm); });
  if (r == 0)
    std::printf("ranks %d, progress %s\n%-15s %10s %12s %12s %12s %12s %12s %7s\n", W,
                dist::progress_mode().c_str(), "collective", "size", "tessera us", "mpi us", "algbw GB/s",
                "busbw GB/s", "mpi busbw", "ratio");
  for (const char* kind : {"all_gather", "reduce_scatter"}) {
    for (double bytes = 4096; bytes <= max_mib * 1048576.0 + 1; bytes *= 4) {
      int64_t total = static_cast<int64_t>(bytes) / 4 / W * W;  // f32 elements of the full buffer
      int64_t shard = total / W;
      Tensor full = randn({total}, 1), part = randn({shard}, 2);
      int reps = std::max(3, static_cast<int>(2e8 / bytes));
      std::vector<double> ours, direct;
      for (int round = 0; round < 5; ++round) {
        pg->barrier()->wait();
        double t0 = now();
        for (int i = 0; i < reps; ++i) {
          if (kind[0] == 'a') pg->all_gather_into_tensor(full, part)->wait();
          else pg->reduce_scatter_tensor(part, full)->wait();
        }
        ours.push_back((now() - t0) / reps);
        pg->barrier()->wait();
        t0 = now();
        raw([&] {
          for (int i = 0; i < reps; ++i) {
            if (kind[0] == 'a')
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
      double factor = W > 1 ? static_cast<double>(W - 1) / W : 1.0;
      if (r == 0)
        std::printf("%-15s %9.0fK %12.1f %12.1f %12.2f %12.2f %12.2f %7.3f\n", kind, size / 1024, to * 1e6,
                    td * 1e6, size / to / 1e9, size / to * factor / 1e9, size / td * factor / 1e9, td / to);
    }
  }
  raw([&] { MPI_Comm_free(&comm); });
  return 0;
}
