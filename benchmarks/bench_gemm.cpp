// GEMM GFLOP/s through Tessera (ops::matmul, allocation and dispatch
// included) against calling OpenBLAS's cblas_sgemm directly on the same
// buffers, interleaved in one run so machine noise hits both alike.
//   bench_gemm [size ...]   (default 256 512 1024)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "runtime/ops.h"
#include "runtime/parallel.h"
#include "runtime/random.h"

using namespace tessera;

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {256, 512, 1024};
  std::printf("threads %d\n%6s %14s %14s %8s\n", num_threads(), "n", "tessera GF/s", "openblas GF/s", "ratio");
  for (int64_t n : sizes) {
    Tensor a = randn({n, n}, 1), b = randn({n, n}, 2);
    Tensor c = empty({n, n});
    double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
    int reps = std::max<int>(3, static_cast<int>(2e10 / flops));
    std::vector<double> ours, direct;
    for (int round = 0; round < 5; ++round) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) Tensor out = ops::matmul(a, b);
      ours.push_back(flops * reps / seconds_since(t0) / 1e9);
      t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data<float>(), n,
                    b.data<float>(), n, 0.0f, c.data<float>(), n);
      direct.push_back(flops * reps / seconds_since(t0) / 1e9);
    }
    std::sort(ours.begin(), ours.end());
    std::sort(direct.begin(), direct.end());
    double mo = ours[2], md = direct[2];  // medians of 5 interleaved rounds
    std::printf("%6lld %14.1f %14.1f %8.3f\n", static_cast<long long>(n), mo, md, mo / md);
  }
}
