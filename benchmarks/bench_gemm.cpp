// GEMM GFLOP/s per shape, for each path, against this CPU's measured peak.
//   bench_gemm [--square n ... | --products NN|NT|TN|TT m n k ...]
// Paths, interleaved in one run so machine noise hits them alike (medians of 5
// rounds): Tessera (ops::matmul on the operand views a training step uses:
// allocation and dispatch included; the library runtime/cpu/blas.cpp picks
// for this CPU, on its thread-count-independent grid), the same with oneDNN
// forced for every piece, and OpenBLAS's cblas_sgemm called directly on the
// same buffers with its own threading (Tessera's path before oneDNN).
// Shapes: the Linear products of a GPT layer at 1024 and 2048 rows (B x T),
// d = 256 and 768: forward x W^T (NT), input gradient dY W (NN), weight
// gradient dY^T X (TN).
// Peak: a register-only FMA loop on every thread (AVX-512 where the CPU has
// it, else AVX2+FMA), the most f32 FLOP/s the cores can issue.
// bf16 (where oneDNN has bf16 kernels for this CPU): the same products on bf16
// operands through ops::matmul (f32 accumulation, bf16 result), against two
// measured bf16 peaks: AVX512-BF16's dot product (vdpbf16ps) on both FMA
// pipes, and AMX's tile multiply (tdpbf16ps) where the CPU has AMX. Where
// Tessera's own AMX kernel can run (runtime/cpu/amx.h), the same products on
// it and on oneDNN's bf16 kernels, each forced, are timed beside the
// automatic choice ("by": which of the two it made). Where bf16 products run
// on Tessera's f32 kernel instead (AVX2: operands widened as they are packed,
// cpu::bf16_on_own_kernel), the bf16 column times them there ("by": f32own),
// and the summary compares them with the f32 products through Tessera.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/cpu/blas.h"
#include "runtime/cpu/peak.h"
#include "runtime/ops.h"
#include "runtime/parallel.h"
#include "runtime/random.h"

using namespace tessera;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A peak (runtime/cpu/peak.h) on every thread of the pool, in GFLOP/s (0 where the CPU lacks the unit).
double peak_gflops(cpu::PeakUnit unit) { return cpu::measure_peak(unit, num_threads()).flops / 1e9; }

struct Shape3 {
  const char* what;
  bool ta, tb;
  int64_t m, n, k;
};

// The stored operand for op(X) of rows x cols: transposed views where the step has them.
Tensor operand(int64_t rows, int64_t cols, bool trans, uint64_t seed) {
  return trans ? ops::transpose(randn({cols, rows}, seed), 0, 1) : randn({rows, cols}, seed);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape3> shapes;
  for (int64_t rows : {1024, 2048})
    for (int64_t d : {256, 768}) {
      shapes.push_back({"x W1^T", false, true, rows, 4 * d, d});
      shapes.push_back({"h W2^T", false, true, rows, d, 4 * d});
      shapes.push_back({"dY W1", false, false, rows, d, 4 * d});
      shapes.push_back({"dY^T X", true, false, 4 * d, d, rows});
    }
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--products") == 0) {  // --products NN|NT|TN M N K [...]
      shapes.clear();
      for (++i; i + 3 < argc; i += 4) {
        std::string op = argv[i];
        if (op.size() != 2 || (op[0] != 'N' && op[0] != 'T') || (op[1] != 'N' && op[1] != 'T')) {
          std::fprintf(stderr, "bench_gemm: expected NN, NT, TN or TT before m n k, got '%s'\n", argv[i]);
          return 2;
        }
        shapes.push_back({"product", op[0] == 'T', op[1] == 'T', std::atoll(argv[i + 1]), std::atoll(argv[i + 2]),
                          std::atoll(argv[i + 3])});
      }
      break;
    }
    if (std::strcmp(argv[i], "--square") == 0) {
      shapes.clear();
      for (++i; i < argc; ++i) {
        int64_t n = std::atoll(argv[i]);
        shapes.push_back({"square", false, false, n, n, n});
      }
    }
  }
  const cpu::Peak fma = cpu::measure_peak(cpu::PeakUnit::Fma, num_threads());
  const double f32_peak = fma.flops / 1e9;
  std::printf("threads %d; measured peak %.1f GFLOP/s f32 (%s loop, %.1f per thread)\n",
              num_threads(), f32_peak, fma.unit, f32_peak / num_threads());
  const bool bf16 = cpu::bf16_gemm_native();
  const double dp_peak = peak_gflops(cpu::PeakUnit::Bf16Dot), amx_peak = peak_gflops(cpu::PeakUnit::Amx);
  if (bf16)
    std::printf("bf16 peaks: %.1f GFLOP/s AVX512-BF16 dot products (%.1f per thread), %.1f AMX tiles (%.1f per thread)\n",
                dp_peak, dp_peak / num_threads(), amx_peak, amx_peak / num_threads());
  else
    std::printf("bf16: oneDNN has no bf16 kernels for this CPU (bf16 products run on the own f32 kernel, widened "
                "as packed, with AVX2; on f32 copies elsewhere): no bf16 peak to measure\n");
  const bool bf16_own = !bf16 && cpu::bf16_on_own_kernel(), bf16_timed = bf16 || bf16_own;
  const bool amx_kernel = bf16 && cpu::bf16_gemm_amx() && cpu::has_peak_unit(cpu::PeakUnit::Amx);
  const bool own_kernel = cpu::sgemm_own_kernel_here();  // the f32 kernel of runtime/cpu/sgemm_kernel.h
  std::printf("f32 kernels timed: Tessera's choice (auto, by: which), each forced (oneDNN, OpenBLAS and, %s, "
              "the own kernel: its pieces on the shape's grid), and OpenBLAS called directly on the whole product\n",
              own_kernel ? "here" : "not here (baseline copy)");
  std::printf("%-8s %2s %5s %5s %5s %12s %8s %7s %8s %8s %8s %8s %9s %8s %9s %7s %7s %6s %8s %7s %11s %7s\n",
              "product", "op", "m", "n", "k", "tessera GF/s", "of peak", "by", "oneDNN", "OpenBLAS", "own",
              "of peak", "OB direct", "of peak", "bf16", "of dp", "of AMX", "by", "own AMX", "of AMX", "bf16 oneDNN",
              "of AMX");
  double worst = 1e9, ratio_sum = 0, worst_bf16 = 1e9, worst_choice = 1e9, own_bf16_sum = 0;
  for (const Shape3& s : shapes) {
    Tensor a = operand(s.m, s.k, s.ta, 1), b = operand(s.k, s.n, s.tb, 2);
    Tensor a16 = operand(s.m, s.k, s.ta, 1), b16 = operand(s.k, s.n, s.tb, 2);
    a16 = s.ta ? ops::transpose(ops::to(ops::transpose(a16, 0, 1), DType::BF16), 0, 1) : ops::to(a16, DType::BF16);
    b16 = s.tb ? ops::transpose(ops::to(ops::transpose(b16, 0, 1), DType::BF16), 0, 1) : ops::to(b16, DType::BF16);
    Tensor c = empty({s.m, s.n});
    // The stored buffers as BLAS sees them.
    const float* ap = a.data<float>();
    const float* bp = b.data<float>();
    int64_t lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    double flops =
        2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    int reps = std::max<int>(3, static_cast<int>(1e10 / flops));
    std::vector<double> ours, onednn, openblas, own, direct, low, low_own, low_onednn;
    for (int round = 0; round < 5; ++round) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) Tensor out = ops::matmul(a, b);
      ours.push_back(flops * reps / seconds_since(t0) / 1e9);
      for (cpu::SgemmPath path : {cpu::SgemmPath::OneDnn, cpu::SgemmPath::OpenBlas, cpu::SgemmPath::Own}) {
        if (path == cpu::SgemmPath::Own && !own_kernel) continue;
        cpu::SgemmPath saved = cpu::set_sgemm_path(path);
        t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r) Tensor out = ops::matmul(a, b);
        (path == cpu::SgemmPath::OneDnn ? onednn : path == cpu::SgemmPath::OpenBlas ? openblas : own)
            .push_back(flops * reps / seconds_since(t0) / 1e9);
        cpu::set_sgemm_path(saved);
      }
      t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans,
                    s.tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, 1.0f, ap, lda, bp, ldb, 0.0f,
                    c.data<float>(), s.n);
      direct.push_back(flops * reps / seconds_since(t0) / 1e9);
      if (bf16_timed) {
        t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < 2 * reps; ++r) Tensor out = ops::matmul(a16, b16);
        low.push_back(flops * 2 * reps / seconds_since(t0) / 1e9);
      }
      if (amx_kernel) {
        for (cpu::Bf16Path path : {cpu::Bf16Path::Amx, cpu::Bf16Path::OneDnn}) {
          cpu::Bf16Path saved = cpu::set_bf16_path(path);
          t0 = std::chrono::steady_clock::now();
          for (int r = 0; r < 2 * reps; ++r) Tensor out = ops::matmul(a16, b16);
          (path == cpu::Bf16Path::Amx ? low_own : low_onednn).push_back(flops * 2 * reps / seconds_since(t0) / 1e9);
          cpu::set_bf16_path(saved);
        }
      }
    }
    double mo = median(ours), mn = median(onednn), mb = median(openblas), mw = own_kernel ? median(own) : 0,
           md = median(direct), ml = bf16_timed ? median(low) : 0,
           mla = amx_kernel ? median(low_own) : 0, mlo = amx_kernel ? median(low_onednn) : 0;
    const char* by = bf16_own ? "f32own" : !bf16 ? "-" : cpu::bf16_on_amx(s.m, s.n, s.k) ? "own" : "oneDNN";
    own_bf16_sum += bf16_own ? ml / mo : 0;
    const char* f32_by = cpu::sgemm_on_own_kernel(s.ta, s.tb, s.m, s.n, s.k) ? "own" : "library";
    worst = std::min(worst, mo / f32_peak);
    if (bf16) worst_bf16 = std::min(worst_bf16, ml / dp_peak);
    ratio_sum += mo / md;
    worst_choice = std::min(worst_choice, mo / std::max({mn, mb, mw, md}));
    std::printf("%-8s %c%c %5lld %5lld %5lld %12.1f %8.2f %7s %8.1f %8.1f %8.1f %8.2f %9.1f %8.2f %9.1f %7.2f %7.2f "
                "%6s %8.1f %7.2f %11.1f %7.2f\n",
                s.what, s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', static_cast<long long>(s.m), static_cast<long long>(s.n),
                static_cast<long long>(s.k), mo, mo / f32_peak, f32_by, mn, mb, mw,
                std::max({mn, mb, mw}) / f32_peak, md, md / f32_peak, ml, dp_peak > 0 ? ml / dp_peak : 0.0,
                amx_peak > 0 ? ml / amx_peak : 0.0, by, mla, amx_peak > 0 ? mla / amx_peak : 0.0, mlo,
                amx_peak > 0 ? mlo / amx_peak : 0.0);
  }
  std::printf(
      "lowest fraction of peak through Tessera: %.2f f32; Tessera / OpenBLAS direct, mean: %.3f\n",
      worst, ratio_sum / static_cast<double>(shapes.size()));
  std::printf("Tessera's choice against the fastest f32 candidate (each forced, or OpenBLAS direct), lowest: %.2f\n",
              worst_choice);
  if (bf16) std::printf("lowest fraction of the AVX512-BF16 peak, bf16 through Tessera: %.2f\n", worst_bf16);
  if (bf16_own)
    std::printf("bf16 on the own f32 kernel against f32 through Tessera, mean: %.3f\n",
                own_bf16_sum / static_cast<double>(shapes.size()));
}
