// The f32 kernel of sgemm_kernel.h: packing, the MR x NR micro-kernel and the
// tile loop. Compiled in each instruction-set copy (meson.build); the
// baseline copy has none (x86-64 without FMA would round every product), so
// there the libraries run.
#include "runtime/cpu/sgemm_kernel.h"

#include <algorithm>

#include "runtime/check.h"
#include "runtime/cpu/kernels_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace tessera::cpu::TS_CPU_ISA {

namespace {

// One vector of f32 and the operations the kernel uses, per instruction set.
// Edges of C (columns past n) go through masked loads and stores, so every
// result takes the same vector instructions.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kMr = 14;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// The first `lanes` elements (0 < lanes <= kLanes).
inline Vec vload_part(const float* p, int64_t lanes) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lanes) - 1u), p);
}
inline void vstore_part(float* p, Vec v, int64_t lanes) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << lanes) - 1u), v);
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kMr = 6;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline __m256i lane_mask(int64_t lanes) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes)), index);
}
inline Vec vload_part(const float* p, int64_t lanes) { return _mm256_maskload_ps(p, lane_mask(lanes)); }
// Plain stores of 4, 2 and 1 lanes: AMD's Zen runs a masked store
// (vmaskmovps) as a microcoded loop, and packing a transposed operand of
// 6-row panels through it ran at 5 GB/s against 11-12 with these.
inline void vstore_part(float* p, Vec v, int64_t lanes) {
  __m128 half = _mm256_castps256_ps128(v);
  if (lanes >= 4) {
    _mm_storeu_ps(p, half);
    if (lanes == 4) return;
    half = _mm256_extractf128_ps(v, 1), p += 4, lanes -= 4;
  }
  if (lanes >= 2) {
    _mm_storel_pi(reinterpret_cast<__m64*>(p), half);
    half = _mm_movehl_ps(half, half), p += 2, lanes -= 2;
  }
  if (lanes == 1) _mm_store_ss(p, half);
}
#endif

// The operands the packing reads and the results the tiles store: f32 as
// they are, bf16 widened on load (exact: its bits are the f32's top half) and
// rounded to nearest even on store, as float_to_bf16 rounds (NaN stays a
// quiet NaN), so a bf16 product's results are the f32 product's of the
// widened operands, rounded once.
inline float widen(float x) { return x; }
inline float widen(BFloat16 x) { return bf16_to_float(x); }

#if defined(__AVX512F__)
// The zero-masked forms of the conversions throughout: GCC 12 warns that the
// plain ones' undefined upper parts may be used uninitialized.
constexpr __mmask16 kAll = 0xffff;
inline Vec widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, h), 16));
}
inline Vec vload(const BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vload_part(const BFloat16* p, int64_t lanes) {
  return widen(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << lanes) - 1u), p));
}
// Each lane's f32 bits rounded to bf16's, in the low 16 bits of the lane.
inline __m512i round_to_bf16(Vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i high = _mm512_maskz_srli_epi32(kAll, u, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_maskz_srli_epi32(kAll, _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}
inline void vstore(BFloat16* p, Vec v) { _mm512_mask_cvtepi32_storeu_epi16(p, kAll, round_to_bf16(v)); }
inline void vstore_part(BFloat16* p, Vec v, int64_t lanes) {
  _mm512_mask_cvtepi32_storeu_epi16(p, static_cast<__mmask16>((1u << lanes) - 1u), round_to_bf16(v));
}
#else
inline Vec vload(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// Through a zeroed vector's worth: a load of 8 could cross into a page past the end.
inline Vec vload_part(const BFloat16* p, int64_t lanes) {
  alignas(16) BFloat16 part[kLanes] = {};
  std::copy(p, p + lanes, part);
  return vload(part);
}
inline __m256i round_to_bf16(Vec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
// The eight lanes' 16-bit results, in order (packus works within 128-bit halves).
inline __m128i narrow(__m256i lanes) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lanes, lanes), 0x08);
  return _mm256_castsi256_si128(packed);
}
inline void vstore(BFloat16* p, Vec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(round_to_bf16(v))); }
inline void vstore_part(BFloat16* p, Vec v, int64_t lanes) {
  alignas(16) BFloat16 part[kLanes];
  vstore(part, v);
  std::copy(part, part + lanes, p);
}
#endif

// Eight (four) of an operand's values as f32, for the packing's transposes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const BFloat16* p) {
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

constexpr int64_t kNr = 2 * kLanes;  // two vectors of columns
// k per block: a B micro-panel (kKc x kNr) stays in L1 while the tile's A
// panels stream through it from L2.
constexpr int64_t kKc = 256;

// Software prefetch (measured in bench_gemm's shapes: +10-15% on the
// product): the A stream kPrefetchA floats ahead into L1, and the tile's next
// B panel into L2 a slice per A panel while the current one is in use.
constexpr int64_t kPrefetchA = 768;
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out[kk * width + l] = line l's step kk (line l at first + l * across, its
// steps adjacent) for `lines` lines and `steps` steps: 8 x 8 blocks through
// AVX registers (4 x 4 through SSE for fewer than 8 lines), steps past the
// last whole block one at a time.
// r[i] = line i's 8 steps in, step i's 8 lines out.
inline void transpose8_in_registers(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

template <class S>
void transpose8(const S* in, int64_t ld_in, float* out, int64_t ld_out) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(in + i * ld_in);
  transpose8_in_registers(r);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + i * ld_out, r[i]);
}

// Six lines (a panel of the AVX2 copy's A) of 8 steps into out[8][6]: one
// 8 x 8 transpose with two zero lines, each step's vector stored whole over
// the start of the next step's (which the next store writes), the last
// step's six lanes alone.
template <class S>
void transpose6(const S* in, int64_t ld_in, float* out) {
  __m256 r[8];
  for (int i = 0; i < 6; ++i) r[i] = load8(in + i * ld_in);
  r[6] = r[7] = _mm256_setzero_ps();
  transpose8_in_registers(r);
  for (int i = 0; i < 7; ++i) _mm256_storeu_ps(out + i * 6, r[i]);
  _mm_storeu_ps(out + 42, _mm256_castps256_ps128(r[7]));
  _mm_storel_pi(reinterpret_cast<__m64*>(out + 46), _mm256_extractf128_ps(r[7], 1));
}

template <class S>
void transpose4(const S* in, int64_t ld_in, float* out, int64_t ld_out) {
  __m128 r0 = load4(in), r1 = load4(in + ld_in), r2 = load4(in + 2 * ld_in), r3 = load4(in + 3 * ld_in);
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(out, r0);
  _mm_storeu_ps(out + ld_out, r1);
  _mm_storeu_ps(out + 2 * ld_out, r2);
  _mm_storeu_ps(out + 3 * ld_out, r3);
}

template <class S>
void gather_lines(int64_t steps, int64_t lines, const S* first, int64_t across, int64_t width, float* out) {
  if (lines == 6 && width == 6) {  // a whole panel of the AVX2 copy's A: 8 steps per transpose
    int64_t kk = 0;
    for (; kk + 8 <= steps; kk += 8) transpose6(first + kk, across, out + kk * 6);
    for (; kk < steps; ++kk)
      for (int64_t i = 0; i < 6; ++i) out[kk * 6 + i] = widen(first[i * across + kk]);
    return;
  }
  // Groups of 8 (or 4) lines; where `lines` is not a multiple of the group,
  // the last group overlaps the one before it (those lines are written twice,
  // with the same values), so every line goes through the registers.
  const int64_t group = lines >= 8 ? 8 : lines >= 4 ? 4 : 1;
  for (int64_t g = 0; g < lines; g += group) {
    const int64_t l = std::min(g, lines - group);
    int64_t kk = 0;
    if (group == 8)
      for (; kk + 8 <= steps; kk += 8) transpose8(first + l * across + kk, across, out + kk * width + l, width);
    if (group == 4)
      for (; kk + 4 <= steps; kk += 4) transpose4(first + l * across + kk, across, out + kk * width + l, width);
    for (; kk < steps; ++kk)
      for (int64_t i = 0; i < group; ++i) out[kk * width + l + i] = widen(first[(l + i) * across + kk]);
  }
}

// Steps [s0, s1) of k of every panel of `width` lines (rows of op(A), or
// columns of op(B)), zeros past `lines`. Line l at step kk is
// x[l * across + kk * along], and one of the strides is 1. Block b (steps
// b * kKc on, kc of them) of panel p starts at packed + b * kKc * panels * width
// + p * kc * width, so that a tile's panels of one block are one run of
// memory; within it, step kk's `width` values are adjacent. Where lines are
// adjacent (across == 1) each step is a run of memory: kRowSteps of them
// across all panels, then the next, keep the reads in a few open runs,
// where a block of steps per panel would read a line per step (a page per
// step: 2-3x slower on the AVX2 EPYC). Where steps are adjacent, each
// panel's lines are read along a whole block of steps (runs of 32 steps were
// 3x slower on a 3072-line operand).
template <int64_t width, class S>
void pack_steps(int64_t k, int64_t lines, const S* x, int64_t along, int64_t across, int64_t s0, int64_t s1,
                float* packed) {
  const int64_t panels = ceil_div(lines, width);
  constexpr int64_t kRowSteps = 8;
  const int64_t run = across == 1 ? kRowSteps : kKc;
  for (int64_t s = s0; s < s1;) {
    const int64_t kb = s / kKc * kKc, kc = std::min(kKc, k - kb), end = std::min({s1, kb + kc, s + run});
    float* block = packed + kb * panels * width;
    const int64_t steps = end - s;
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t valid = std::min(width, lines - p * width);
      const S* first = x + p * width * across + s * along;
      float* out = block + p * kc * width + (s - kb) * width;
      if (across == 1 && width < kLanes) {  // each step: `valid` adjacent floats, one vector
        // Whole loads where the vector's lanes past the panel are the next
        // panel's lines, and whole stores over the start of the next step's
        // (which the next store writes) but for the last step.
        const bool whole = p * width + kLanes <= lines;
        for (int64_t kk = 0; kk < steps; ++kk) {
          const Vec v = whole ? vload(first + kk * along) : vload_part(first + kk * along, valid);
          if (kk + 1 < steps) vstore(out + kk * width, v);
          else vstore_part(out + kk * width, v, width);
        }
      } else if (across == 1) {  // each step: `valid` adjacent floats, a vector (or part of one) at a time
        for (int64_t kk = 0; kk < steps; ++kk) {
          const S* from = first + kk * along;
          float* to = out + kk * width;
          for (int64_t h = 0; h < width; h += kLanes) {
            const int64_t have = std::clamp<int64_t>(valid - h, 0, kLanes), room = std::min(kLanes, width - h);
            const Vec v = have == kLanes ? vload(from + h) : have > 0 ? vload_part(from + h, have) : vzero();
            if (room == kLanes) vstore(to + h, v);
            else vstore_part(to + h, v, room);
          }
        }
      } else {  // each line: adjacent along k
        gather_lines(steps, valid, first, across, width, out);
        for (int64_t kk = 0; kk < steps; ++kk) std::fill(out + kk * width + valid, out + (kk + 1) * width, 0.0f);
      }
    }
    s = end;
  }
}

// The kMr x kNr sums of a micro-tile over `depth` steps of k of an A
// micro-panel and a B micro-panel (both packed, at the block's first step),
// added to `start`'s (zeros where it is null), into `sums`; both kMr x kNr,
// rows kNr apart. The sums live in registers throughout (a fixed count of
// each, so the compiler keeps them there).
__attribute__((noinline)) void micro_kernel(int64_t depth, const float* pa, const float* pb, const float* start,
                                            float* sums) {
  Vec acc[kMr][2];
  if (start == nullptr) {
#pragma GCC unroll 32
    for (int64_t i = 0; i < 2 * kMr; ++i) acc[i / 2][i % 2] = vzero();
  } else {
#pragma GCC unroll 32
    for (int64_t i = 0; i < 2 * kMr; ++i) acc[i / 2][i % 2] = vload(start + (i / 2) * kNr + (i % 2) * kLanes);
  }
  for (int64_t kk = 0; kk < depth; ++kk, pa += kMr, pb += kNr) {
    const Vec b0 = vload(pb), b1 = vload(pb + kLanes);
    _mm_prefetch(reinterpret_cast<const char*>(pa + kPrefetchA), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kMr; ++r) {
      const Vec a = vbroadcast(pa + r);
      acc[r][0] = vfma(a, b0, acc[r][0]);
      acc[r][1] = vfma(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 32
  for (int64_t i = 0; i < 2 * kMr; ++i) vstore(sums + (i / 2) * kNr + (i % 2) * kLanes, acc[i / 2][i % 2]);
}

// alpha * sums (+ beta * C) into C's rows x cols (at most kMr x kNr) at c.
template <class T>
void store_results(const float* sums, int64_t rows, int64_t cols, float alpha, float beta, T* c, int64_t ldc) {
  const Vec va = vset(alpha), vb = vset(beta);
  for (int64_t r = 0; r < rows; ++r) {
    T* row = c + r * ldc;
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t lanes = std::min(kLanes, cols - h * kLanes);
      if (lanes <= 0) break;
      const Vec sum = vload(sums + r * kNr + h * kLanes);
      Vec v = alpha == 1.0f ? sum : vmul(va, sum);
      if (lanes == kLanes) {
        if (beta != 0.0f) v = vfma(vb, vload(row + h * kLanes), v);
        vstore(row + h * kLanes, v);
      } else {
        if (beta != 0.0f) v = vfma(vb, vload_part(row + h * kLanes, lanes), v);
        vstore_part(row + h * kLanes, v, lanes);
      }
    }
  }
}

// Asks for the lines of C's rows x cols results at c (each 64-byte stretch
// of a row and its last result: a row may straddle one more line), so that
// the stores after the tile's last block find them in cache: issued before
// the block's steps of k, they arrive while the micro-kernel runs. Measured
// 1.008-1.039x per product at 1 thread on the AVX2 EPYC, where the stores
// into a C out of cache had held up the tile loop (benchmarks/README.md).
template <class T>
void prefetch_tile(const T* c, int64_t rows, int64_t cols, int64_t ldc) {
  constexpr int64_t kResult = sizeof(T), kLine = 64;  // bytes
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(c + r * ldc);
    for (int64_t o = 0; o < cols * kResult; o += kLine) _mm_prefetch(row + o, _MM_HINT_T0);
    _mm_prefetch(row + (cols - 1) * kResult, _MM_HINT_T0);
  }
}

// sgemm_multiply into a C of T (f32, or bf16 rounded as each tile is stored).
template <class T>
void multiply_tiles(int64_t m, int64_t n, int64_t k, const float* packed_a, const float* packed_b, int64_t i0,
                    int64_t rows, int64_t j0, int64_t cols, int64_t k0, int64_t depth, float alpha, float beta, T* c,
                    int64_t ldc, float* partials) {
  TS_CHECK(i0 % kMr == 0 && j0 % kNr == 0 && k0 % kKc == 0,
           "sgemm_multiply: a tile starts on a panel and a block of k (row {}, column {}, step {})", i0, j0, k0);
  const int64_t panels_a = ceil_div(rows, kMr), panels_b = ceil_div(cols, kNr);
  const int64_t all_a = ceil_div(m, kMr), all_b = ceil_div(n, kNr);
  for (int64_t kb = k0; kb < k0 + depth; kb += kKc) {
    const int64_t kc = std::min(kKc, k - kb);  // the packed block's depth
    const bool first = kb == k0, last = kb + kKc >= k0 + depth;
    // The tile's panels of this block, one run each for A and B.
    const float* a = packed_a + kb * all_a * kMr + (i0 / kMr) * kc * kMr;
    const float* b = packed_b + kb * all_b * kNr + (j0 / kNr) * kc * kNr;
    for (int64_t q = 0; q < panels_b; ++q) {
      const float* pb = b + q * kc * kNr;
      for (int64_t p = 0; p < panels_a; ++p) {
        const float* pa = a + p * kc * kMr;
        if (q + 1 < panels_b) {  // the next B panel, a slice per A panel
          const char* next = reinterpret_cast<const char*>(pb + kc * kNr);
          const int64_t bytes = kc * kNr * static_cast<int64_t>(sizeof(float)), slice = ceil_div(bytes, panels_a);
          for (int64_t o = p * slice; o < std::min(bytes, (p + 1) * slice); o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
        }
        // Between blocks the kMr x kNr sums wait in `partials`, a micro-tile at a time.
        float* waiting = first && last ? nullptr : partials + (q * panels_a + p) * kMr * kNr;
        alignas(64) float sums[kMr * kNr];
        const int64_t tile_rows = std::min(kMr, rows - p * kMr), tile_cols = std::min(kNr, cols - q * kNr);
        T* tile = c + p * kMr * ldc + q * kNr;
        if (last) prefetch_tile(tile, tile_rows, tile_cols, ldc);
        micro_kernel(kc, pa, pb, first ? nullptr : waiting, last ? sums : waiting);
        if (last) store_results(sums, tile_rows, tile_cols, alpha, beta, tile, ldc);
      }
    }
  }
}

}  // namespace

int64_t sgemm_mr() { return kMr; }
int64_t sgemm_nr() { return kNr; }

void sgemm_pack_a(bool trans, int64_t m, int64_t k, const float* a, int64_t lda, int64_t s0, int64_t s1,
                  float* packed) {
  // op(A)'s rows: adjacent in memory when A is stored transposed.
  pack_steps<kMr>(k, m, a, trans ? lda : 1, trans ? 1 : lda, s0, s1, packed);
}

void sgemm_pack_b(bool trans, int64_t k, int64_t n, const float* b, int64_t ldb, int64_t s0, int64_t s1,
                  float* packed) {
  // op(B)'s columns: adjacent in memory unless B is stored transposed.
  pack_steps<kNr>(k, n, b, trans ? 1 : ldb, trans ? ldb : 1, s0, s1, packed);
}

void sgemm_pack_a(bool trans, int64_t m, int64_t k, const BFloat16* a, int64_t lda, int64_t s0, int64_t s1,
                  float* packed) {
  pack_steps<kMr>(k, m, a, trans ? lda : 1, trans ? 1 : lda, s0, s1, packed);
}

void sgemm_pack_b(bool trans, int64_t k, int64_t n, const BFloat16* b, int64_t ldb, int64_t s0, int64_t s1,
                  float* packed) {
  pack_steps<kNr>(k, n, b, trans ? 1 : ldb, trans ? ldb : 1, s0, s1, packed);
}

int64_t sgemm_kc() { return kKc; }

int64_t sgemm_partials(int64_t rows, int64_t cols, int64_t depth) {
  return depth > kKc ? ceil_div(rows, kMr) * kMr * ceil_div(cols, kNr) * kNr : 0;
}

void sgemm_multiply(int64_t m, int64_t n, int64_t k, const float* packed_a, const float* packed_b, int64_t i0,
                    int64_t rows, int64_t j0, int64_t cols, int64_t k0, int64_t depth, float alpha, float beta,
                    float* c, int64_t ldc, float* partials) {
  multiply_tiles(m, n, k, packed_a, packed_b, i0, rows, j0, cols, k0, depth, alpha, beta, c, ldc, partials);
}

void sgemm_multiply(int64_t m, int64_t n, int64_t k, const float* packed_a, const float* packed_b, int64_t i0,
                    int64_t rows, int64_t j0, int64_t cols, int64_t k0, int64_t depth, float alpha, float beta,
                    BFloat16* c, int64_t ldc, float* partials) {
  multiply_tiles(m, n, k, packed_a, packed_b, i0, rows, j0, cols, k0, depth, alpha, beta, c, ldc, partials);
}

}  // namespace tessera::cpu::TS_CPU_ISA

#endif  // __AVX2__ && __FMA__
