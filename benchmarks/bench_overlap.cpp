// Does a collective overlap compute? Each rank times (a) a collective of
// SIZE MiB alone (all-gather, reduce-scatter or all-reduce), (b) a compute loop alone (GEMMs through Tessera, so every
// op is an op boundary), (c) the all-reduce issued before the loop and waited
// after it. Exposed communication = (c) - (b); "hidden" = 1 - exposed / (a).
// Run it once per progress mode:
//   TESSERA_PROGRESS=thread mpirun -np 4 -x TESSERA_PROGRESS build/benchmarks/bench_overlap [MiB] [ag|rs|ar]
//   TESSERA_PROGRESS=poll   mpirun -np 4 -x TESSERA_PROGRESS build/benchmarks/bench_overlap [MiB] [ag|rs|ar]
// With a third column for compute issued as one uninterrupted BLAS call per
// iteration (no op boundaries inside), where poll mode cannot make progress.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "runtime/distributed.h"
#include "runtime/ops.h"
#include "runtime/random.h"

using namespace tessera;

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  dist::init(argc, argv);
  auto pg = dist::world();
  double mib = argc > 1 ? std::atof(argv[1]) : 8;
  std::string kind = argc > 2 ? argv[2] : "ag";
  int gemm_n = 192;
  int W = pg->size();
  int64_t total = static_cast<int64_t>(mib * 1048576 / 4) / W * W;  // elements of the full buffer
  Tensor buf = randn({total}, 1), shard = randn({total / W}, 4);
  Tensor a = randn({gemm_n, gemm_n}, 2), b = randn({gemm_n, gemm_n}, 3), c = empty({gemm_n, gemm_n});
  auto comm = [&] {
    if (kind == "rs") return pg->reduce_scatter_tensor(shard, buf);
    if (kind == "ar") return pg->all_reduce(buf);
    return pg->all_gather_into_tensor(buf, shard);
  };
  auto compute_ops = [&](int iters) {
    for (int i = 0; i < iters; ++i) Tensor out = ops::matmul(a, b);
  };
  auto compute_raw = [&](int iters) {  // no op boundary inside: BLAS directly
    for (int i = 0; i < iters; ++i)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, gemm_n, gemm_n, gemm_n, 1.f, a.data<float>(), gemm_n,
                  b.data<float>(), gemm_n, 0.f, c.data<float>(), gemm_n);
  };
  // Size the compute loop to ~3x the communication time.
  std::vector<double> tc;
  for (int i = 0; i < 5; ++i) {
    pg->barrier()->wait();
    double t0 = now();
    comm()->wait();
    tc.push_back(now() - t0);
  }
  double t_comm = median(tc);
  std::vector<double> tg;
  for (int i = 0; i < 5; ++i) {
    double t1 = now();
    compute_ops(20);
    tg.push_back((now() - t1) / 20);
  }
  double per_gemm = median(tg), t0 = 0;
  int iters = std::max(1, static_cast<int>(std::max(3 * t_comm, 0.02) / per_gemm));  // >= 20 ms of compute
  std::vector<double> alone, both, alone_raw, both_raw;
  for (int round = 0; round < 9; ++round) {
    pg->barrier()->wait();
    t0 = now();
    compute_ops(iters);
    alone.push_back(now() - t0);
    pg->barrier()->wait();
    t0 = now();
    auto w = comm();
    compute_ops(iters);
    w->wait();
    both.push_back(now() - t0);
    pg->barrier()->wait();
    t0 = now();
    compute_raw(iters);
    alone_raw.push_back(now() - t0);
    pg->barrier()->wait();
    t0 = now();
    w = comm();
    compute_raw(iters);
    w->wait();
    both_raw.push_back(now() - t0);
  }
  double exposed = std::max(0.0, median(both) - median(alone));
  double exposed_raw = std::max(0.0, median(both_raw) - median(alone_raw));
  if (pg->rank() == 0) {
    std::printf("ranks %d, progress %s, %s %.1f MiB: %.2f ms alone; compute %.2f ms (%d GEMMs %d^3)\n",
                pg->size(), dist::progress_mode().c_str(), kind.c_str(), mib, t_comm * 1e3, median(alone) * 1e3,
                iters, gemm_n);
    std::printf("  ops compute:  comm+compute %.2f ms, exposed %.2f ms, hidden %.0f%%\n", median(both) * 1e3,
                exposed * 1e3, 100.0 * (1.0 - std::min(1.0, exposed / t_comm)));
    std::printf("  raw BLAS:     comm+compute %.2f ms, exposed %.2f ms, hidden %.0f%%\n", median(both_raw) * 1e3,
                exposed_raw * 1e3, 100.0 * (1.0 - std::min(1.0, exposed_raw / t_comm)));
  }
  return 0;
}
