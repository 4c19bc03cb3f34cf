// Register-only loops: twelve independent accumulator chains hide the FMA
// latency on two pipes (four tile accumulators for AMX); nothing touches
// memory inside the loop. Each is written out per instruction set (a
// template would not inline across target attributes).
#include "runtime/cpu/peak.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "runtime/cpu/blas.h"
#include "runtime/cpu/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__)
// In the namespaces of the instruction-set copies (tests/tools/check_isa.sh
// checks that wider instructions appear nowhere else); each runs only where
// the CPU has its extension.
namespace tessera::cpu::avx512 {
namespace {

__attribute__((target("avx512f"))) float fma_loop_avx512(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  float sink = 0, lanes[16];
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_ps(lanes, acc[i]);
    sink += lanes[0];
  }
  return sink;
}

}  // namespace
}  // namespace tessera::cpu::avx512

namespace tessera::cpu::avx2 {
namespace {

__attribute__((target("avx2,fma"))) float fma_loop_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  float sink = 0, lanes[8];
  for (int i = 0; i < 12; ++i) {
    _mm256_storeu_ps(lanes, acc[i]);
    sink += lanes[0];
  }
  return sink;
}

}  // namespace
}  // namespace tessera::cpu::avx2

namespace tessera::cpu::avx512 {
namespace {

// vdpbf16ps: 16 f32 lanes, each += two bf16 products (4 FLOPs per lane).
__attribute__((target("avx512f,avx512bf16"))) float dpbf16_loop(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, x);
  float sink = 0, lanes[16];
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_ps(lanes, acc[i]);
    sink += lanes[0];
  }
  return sink;
}

// tdpbf16ps on full tiles: C (16 x 16 f32) += A (16 x 32 bf16) B (32 x 16, as
// 16 rows of 16 pairs): 16 * 16 * 32 * 2 FLOPs per instruction.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
__attribute__((target("amx-tile,amx-bf16"))) float amx_loop(int64_t iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t ab[16 * 32];
  alignas(64) float c[16 * 16];
  std::fill(ab, ab + 16 * 32, uint16_t{0x3a83});  // bf16 1e-3
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_zero(0);  // tile numbers are immediates
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0];
}

}  // namespace
}  // namespace tessera::cpu::avx512
#endif

namespace tessera::cpu {

namespace {

#if defined(__x86_64__)
using avx2::fma_loop_avx2;
using avx512::amx_loop;
using avx512::dpbf16_loop;
using avx512::fma_loop_avx512;

// Linux hands out AMX's tile state to a process on request only.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return permitted;
}

bool cpu_has_amx() {
#if defined(__GNUC__) && !defined(__clang__)
  return __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
}
#endif

float fma_loop_scalar(int64_t iters) {
  float acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = 1.0f + 1e-7f * static_cast<float>(i);
  for (int64_t it = 0; it < iters; ++it)
    for (float& a : acc) a = a * 0.999999f + 1e-7f;
  float sink = 0;
  for (float a : acc) sink += a;
  return sink;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The best of 3 rounds of loop(iters) on `threads` threads at once, in FLOP/s.
template <class F>
double best_rate(int threads, int64_t iters, double flops_per_iter, F&& loop) {
  double best = 0;
  std::atomic<float> sink{0};
  for (int round = 0; round < 3; ++round) {
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      float s = loop(iters);
      float old = sink.load();
      while (!sink.compare_exchange_weak(old, old + s)) {
      }
    }
    best = std::max(best, flops_per_iter * static_cast<double>(iters) * threads / seconds_since(t0));
  }
  if (sink.load() == 42.0f) best += 0;  // keeps the loops' results alive
  return best;
}

}  // namespace

bool has_peak_unit(PeakUnit unit) {
#if defined(__x86_64__)
  switch (unit) {
    case PeakUnit::Fma: return true;
    case PeakUnit::Bf16Dot: return __builtin_cpu_supports("avx512bf16");
    case PeakUnit::Amx: return cpu_has_amx() && amx_permitted();
  }
  return false;
#else
  return unit == PeakUnit::Fma;
#endif
}

Peak measure_peak(PeakUnit unit, int threads) {
  threads = std::max(threads, 1);
  switch (unit) {
    case PeakUnit::Fma:  // as wide as the products run
#if defined(__x86_64__)
      // AVX-512 where the kernels and oneDNN run it (TESSERA_CPU_ISA caps
      // both); else AVX2 where the CPU has it, whatever the cap: OpenBLAS,
      // which takes the large f32 products below the avx512 copy, keeps its
      // AVX2 kernels (a scalar peak under the baseline cap gave MFU 130%).
      if (active_isa() == Isa::Avx512 && __builtin_cpu_supports("avx512f"))
        return {best_rate(threads, 10'000'000, 2.0 * 16 * 12, fma_loop_avx512), "AVX-512 FMA"};
      if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return {best_rate(threads, 10'000'000, 2.0 * 8 * 12, fma_loop_avx2), "AVX2 FMA"};
#endif
      return {best_rate(threads, 10'000'000, 2.0 * 12, fma_loop_scalar), "scalar FMA"};
    case PeakUnit::Bf16Dot:
#if defined(__x86_64__)
      if (has_peak_unit(unit)) return {best_rate(threads, 3'000'000, 16.0 * 4 * 12, dpbf16_loop), "AVX512-BF16"};
#endif
      return {0, "AVX512-BF16"};
    case PeakUnit::Amx:
#if defined(__x86_64__)
      if (has_peak_unit(unit)) return {best_rate(threads, 1'500'000, 4.0 * 16 * 16 * 32 * 2, amx_loop), "AMX"};
#endif
      return {0, "AMX"};
  }
  return {};
}

Peak measure_dtype_peak(DType dtype, int threads) {
  if (dtype == DType::BF16 && bf16_gemm_native() && !bf16_on_own_kernel()) {  // else bf16 products run in f32
    if (bf16_gemm_amx() && has_peak_unit(PeakUnit::Amx)) return measure_peak(PeakUnit::Amx, threads);
    if (has_peak_unit(PeakUnit::Bf16Dot)) return measure_peak(PeakUnit::Bf16Dot, threads);
  }
  Peak p = measure_peak(PeakUnit::Fma, threads);
  if (dtype == DType::F64) p.flops /= 2;
  return p;
}

}  // namespace tessera::cpu
