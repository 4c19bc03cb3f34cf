// The experts of an MoE layer run one GEMM triple per expert
// (nn::GroupedExperts::run). Against the floor a grouped GEMM could reach:
// one SwiGLU over all the rows with one expert's weights, the same FLOPs in
// three large products. Forward + backward (median of repeated steps), per
// shape, with the rows spread evenly over the experts and skewed (half of
// them to one expert). A ratio near 1 means per-expert GEMMs cost no more
// than one grouped product would.
//   OMP_NUM_THREADS=1 build/benchmarks/bench_moe_experts
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <vector>

#include "autograd/functions.h"
#include "autograd/tape.h"
#include "nn/moe.h"
#include "runtime/parallel.h"
#include "runtime/random.h"

using namespace tessera;

namespace {

double median_ms(nn::GroupedExperts& experts, const Tensor& x, const std::vector<int64_t>& counts, int reps) {
  std::vector<double> ms;
  for (int i = 0; i <= reps; ++i) {
    Tensor xr = ops::clone(x);
    xr.set_requires_grad(true);
    const auto t0 = std::chrono::steady_clock::now();
    Tensor y = experts.run(xr, counts);
    autograd::backward(sum(y));
    if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    for (auto& p : experts.parameters()) p.grad() = Tensor();
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main() {
  std::printf("threads %d; forward + backward of the experts, ms (median)\n", num_threads());
  std::printf("%-34s %10s %10s %8s %10s %8s\n", "rows x width x expert width, E", "one GEMM", "balanced", "ratio",
              "skewed", "ratio");
  struct Shape {
    int64_t rows, dim, hidden, experts;
  };
  for (const Shape s : {Shape{4096, 128, 128, 8}, Shape{4096, 512, 1024, 8}, Shape{2048, 768, 2048, 16}}) {
    nn::GroupedExperts dense(1, s.dim, s.hidden, 0.02, Device::cpu()), grouped(s.experts, s.dim, s.hidden, 0.02,
                                                                                Device::cpu());
    dense.reset_parameters(1, "dense.");
    grouped.reset_parameters(2, "grouped.");
    Tensor x = randn({s.rows, s.dim}, 3);
    const std::vector<int64_t> balanced(static_cast<size_t>(s.experts), s.rows / s.experts);
    // Half the rows to one expert, the rest spread over the others.
    std::vector<int64_t> skewed(static_cast<size_t>(s.experts), (s.rows - s.rows / 2) / (s.experts - 1));
    skewed[0] = s.rows / 2;
    skewed.back() += s.rows - std::accumulate(skewed.begin(), skewed.end(), int64_t{0});
    const int reps = s.dim >= 512 ? 5 : 15;
    const double one = median_ms(dense, x, {s.rows}, reps);
    const double even = median_ms(grouped, x, balanced, reps), skew = median_ms(grouped, x, skewed, reps);
    char label[64];
    std::snprintf(label, sizeof label, "%lld x %lld x %lld, %lld", static_cast<long long>(s.rows),
                  static_cast<long long>(s.dim), static_cast<long long>(s.hidden), static_cast<long long>(s.experts));
    std::printf("%-34s %10.2f %10.2f %8.2f %10.2f %8.2f\n", label, one, even, even / one, skew, skew / one);
  }
  return 0;
}
