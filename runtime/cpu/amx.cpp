// The AMX kernel of amx.h: packing, the 32 x 32 tile loop, and a vectorised
// store of its results.
#include "runtime/cpu/amx.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "runtime/check.h"
#include "runtime/cpu/peak.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tessera::cpu::amx {

int64_t panels(int64_t size) {
  return (size + kPanel - 1) / kPanel;
}
int64_t blocks(int64_t k) {
  return (k + kBlock - 1) / kBlock;
}
int64_t packed_a_elements(int64_t m, int64_t k) {
  return panels(m) * blocks(k) * kBlockElements;
}
int64_t packed_b_elements(int64_t k, int64_t n) {
  return panels(n) * blocks(k) * kBlockElements;
}

namespace {

// Column jj of a B panel (0..31), k pair r (0..15), element e of the pair.
int64_t b_at(int64_t jj, int64_t r, int64_t e) {
  return (jj / 16) * 512 + r * 32 + (jj % 16) * 2 + e;
}

// One block of A (rows x depth of it, from `a` at the block's first element),
// zeros past its edges; any block, one element at a time.
void pack_a_block(bool trans, int64_t rows, int64_t depth, const BFloat16* a, int64_t lda,
                  BFloat16* block) {
  std::memset(static_cast<void*>(block), 0, kBlockElements * sizeof(BFloat16));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < depth; ++c)
      block[r * kBlock + c] = trans ? a[c * lda + r] : a[r * lda + c];
}

void pack_b_block(bool trans, int64_t depth, int64_t cols, const BFloat16* b, int64_t ldb,
                  BFloat16* block) {
  std::memset(static_cast<void*>(block), 0, kBlockElements * sizeof(BFloat16));
  for (int64_t kk = 0; kk < depth; ++kk)
    for (int64_t jj = 0; jj < cols; ++jj)
      block[b_at(jj, kk / 2, kk % 2)] = trans ? b[jj * ldb + kk] : b[kk * ldb + jj];
}

}  // namespace

}  // namespace tessera::cpu::amx

#if defined(__x86_64__)
// In the avx512 copy's namespace (tests/tools/check_isa.sh): it runs only
// where amx::usable(), on CPUs that have AVX-512 BW as well.
// GCC 12 takes the intrinsics' _mm512_undefined_* results for uninitialised
// reads once inlined under a target attribute (a false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace tessera::cpu::avx512 {
namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The full 32 x 32 blocks of the packing (amx.h's layouts), 16 lanes at a time.
__attribute__((target("avx512f,avx512bw,avx512vl"))) __m512i pair_rows(const BFloat16* even,
                                                                       const BFloat16* odd) {
  __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)));
  __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// op(A)'s block from `src`, its (0, 0) element; A is stored k x m when transposed.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void full_a_block(bool trans,
                                                                       const BFloat16* src,
                                                                       int64_t lda,
                                                                       BFloat16* block) {
  using amx::kBlock;
  if (!trans) {
    for (int64_t r = 0; r < amx::kPanel; ++r)
      _mm512_storeu_si512(block + r * kBlock, _mm512_loadu_si512(src + r * lda));
    return;
  }
  // Rows 2p and 2p + 1 of the stored block (k) paired along its 32 columns
  // (the block's rows), then the pairs of each row gathered.
  alignas(64) uint32_t pairs[16][32];
  for (int64_t p = 0; p < 16; ++p)
    for (int64_t h = 0; h < 2; ++h)
      _mm512_store_si512(&pairs[p][h * 16],
                         pair_rows(src + 2 * p * lda + h * 16, src + (2 * p + 1) * lda + h * 16));
  const __m512i down =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(32));
  for (int64_t r = 0; r < amx::kPanel; ++r)
    _mm512_storeu_si512(block + r * kBlock, _mm512_i32gather_epi32(down, &pairs[0][r], 4));
}

// op(B)'s block from `src`, its (0, 0) element; B is stored n x k when transposed.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void full_b_block(bool trans,
                                                                       const BFloat16* src,
                                                                       int64_t ldb,
                                                                       BFloat16* block) {
  const __m512i across =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(static_cast<int32_t>(ldb)));
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t r = 0; r < 16; ++r) {  // k pair r of columns h * 16 .. h * 16 + 15
      __m512i v = trans ? _mm512_i32gather_epi32(across, src + h * 16 * ldb + 2 * r, 2)
                        : pair_rows(src + 2 * r * ldb + h * 16, src + (2 * r + 1) * ldb + h * 16);
      _mm512_storeu_si512(block + h * 512 + r * 32, v);
    }
}

// Rounds 16 f32 to bf16 as float_to_bf16 does (to nearest even; NaN stays a quiet NaN).
__attribute__((target("avx512f,avx512bw,avx512vl"))) __m256i to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000));
  __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

// C[rows, cols] = alpha * acc + beta * C for a 32 x 32 block of sums (row stride 32).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void store_block(const float* acc,
                                                                      int64_t rows, int64_t cols,
                                                                      float alpha, float beta,
                                                                      amx::Out out) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < 2; ++h) {
      int64_t n = std::clamp<int64_t>(cols - h * 16, 0, 16);
      if (n == 0) break;
      auto mask = static_cast<__mmask16>((1u << n) - 1);
      __m512 v = _mm512_loadu_ps(acc + r * 32 + h * 16);
      if (alpha != 1.f) v = _mm512_mul_ps(va, v);
      if (out.f32) {
        float* c = static_cast<float*>(out.c) + r * out.ldc + h * 16;
        if (beta != 0.f) v = _mm512_add_ps(v, _mm512_mul_ps(vb, _mm512_maskz_loadu_ps(mask, c)));
        _mm512_mask_storeu_ps(c, mask, v);
      } else {
        uint16_t* c = static_cast<uint16_t*>(out.c) + r * out.ldc + h * 16;
        if (beta != 0.f) {
          __m512i wide =
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, c)), 16);
          v = _mm512_add_ps(v, _mm512_mul_ps(vb, _mm512_castsi512_ps(wide)));
        }
        _mm256_mask_storeu_epi16(c, mask, to_bf16(v));
      }
    }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl"))) void multiply_tiles(
    int64_t m, int64_t n, int64_t k, const BFloat16* packed_a, const BFloat16* packed_b,
    int64_t ip0, int64_t ip1, int64_t jp0, int64_t jp1, int64_t kb0, int64_t kb1, float alpha,
    float beta, amx::Out out) {
  using amx::kBlockElements;
  using amx::kPanel;
  TileConfig config;
  for (int t = 0; t < 8; ++t) {  // 0-3: the four accumulators; 4, 5: A; 6, 7: B
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  constexpr int64_t kChunk = 8;
  const int64_t kb = amx::blocks(k), panels_j = jp1 - jp0;
  // The piece's sums, a 32 x 32 block per pair of panels, kept between
  // chunks of k (in L2: 256 KB for a piece of 256 x 256).
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>((ip1 - ip0) * panels_j * kPanel * kPanel));
  const size_t es = out.f32 ? sizeof(float) : sizeof(BFloat16);
  // k in chunks of kChunk blocks: an A panel's chunk (16 KB) stays in L1
  // while the piece's B panels' chunks (at most 8: 128 KB) stream from L2.
  for (int64_t c0 = kb0; c0 < kb1; c0 += kChunk) {
    const int64_t c1 = std::min(kb1, c0 + kChunk);
    for (int64_t ip = ip0; ip < ip1; ++ip)
      for (int64_t jp = jp0; jp < jp1; ++jp) {
        float* acc = sums.data() + ((ip - ip0) * panels_j + (jp - jp0)) * kPanel * kPanel;
        if (c0 == kb0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, acc, 128);
          _tile_loadd(1, acc + 16, 128);
          _tile_loadd(2, acc + 512, 128);
          _tile_loadd(3, acc + 528, 128);
        }
        const BFloat16* a = packed_a + (ip * kb + c0) * kBlockElements;
        const BFloat16* b = packed_b + (jp * kb + c0) * kBlockElements;
        for (int64_t q = c0; q < c1; ++q, a += kBlockElements, b += kBlockElements) {
          _tile_loadd(4, a, 64);
          _tile_loadd(5, a + 512, 64);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc, 128);
        _tile_stored(1, acc + 16, 128);
        _tile_stored(2, acc + 512, 128);
        _tile_stored(3, acc + 528, 128);
        if (c1 < kb1) continue;
        // out holds the piece's first result, (ip0, jp0)'s.
        int64_t at = (ip - ip0) * kPanel * out.ldc + (jp - jp0) * kPanel;
        amx::Out block{static_cast<char*>(out.c) + static_cast<size_t>(at) * es, out.ldc, out.f32};
        store_block(acc, std::min(kPanel, m - ip * kPanel), std::min(kPanel, n - jp * kPanel),
                    alpha, beta, block);
      }
  }
  _tile_release();
}

}  // namespace
}  // namespace tessera::cpu::avx512
#pragma GCC diagnostic pop
#endif

namespace tessera::cpu::amx {

bool usable() {
  static const bool ok = has_peak_unit(PeakUnit::Amx);
  return ok;
}

void multiply(int64_t m, int64_t n, int64_t k, const BFloat16* packed_a, const BFloat16* packed_b,
              int64_t ip0, int64_t ip1, int64_t jp0, int64_t jp1, int64_t kb0, int64_t kb1,
              float alpha, float beta, Out out) {
  TS_CHECK(usable(), "amx::multiply: this CPU has no AMX-BF16 tiles, or Linux did not grant them");
#if defined(__x86_64__)
  avx512::multiply_tiles(m, n, k, packed_a, packed_b, ip0, ip1, jp0, jp1, kb0, kb1, alpha, beta,
                         out);
#else
  (void)m, (void)n, (void)k, (void)packed_a, (void)packed_b, (void)ip0, (void)ip1, (void)jp0,
      (void)jp1, (void)kb0, (void)kb1, (void)alpha, (void)beta, (void)out;
#endif
}

namespace {

void full_a_block(bool trans, const BFloat16* src, int64_t lda, BFloat16* block) {
#if defined(__x86_64__)
  avx512::full_a_block(trans, src, lda, block);
#else
  pack_a_block(trans, kPanel, kBlock, src, lda, block);
#endif
}

void full_b_block(bool trans, const BFloat16* src, int64_t ldb, BFloat16* block) {
#if defined(__x86_64__)
  // The gathers' offsets (up to 15 ldb elements) are 32-bit.
  if (trans && ldb > std::numeric_limits<int32_t>::max() / 16)
    pack_b_block(trans, kBlock, kPanel, src, ldb, block);
  else
    avx512::full_b_block(trans, src, ldb, block);
#else
  pack_b_block(trans, kBlock, kPanel, src, ldb, block);
#endif
}

}  // namespace

namespace {

// Panels [p0, p1) of an operand `size` wide (A's rows, B's columns) and k
// deep, stored with k along its rows (`k_along_rows`) or down its columns:
// the full blocks through `full`, the vectorised copies above (amx.h's
// kernel runs only on CPUs with AVX-512 BW), the edges through `edge`, one
// element at a time.
template <class Full, class Edge>
void pack_panels(int64_t size, int64_t k, const BFloat16* x, int64_t ld, bool k_along_rows,
                 int64_t p0, int64_t p1, BFloat16* packed, Full full, Edge edge) {
  const int64_t kb = blocks(k);
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t q = 0; q < kb; ++q) {
      BFloat16* block = packed + ((p - p0) * kb + q) * kBlockElements;
      int64_t i0 = p * kPanel, width = std::min(kPanel, size - i0);
      int64_t k0 = q * kBlock, depth = std::min(kBlock, k - k0);
      const BFloat16* src = k_along_rows ? x + i0 * ld + k0 : x + k0 * ld + i0;
      if (width == kPanel && depth == kBlock)
        full(src, block);
      else
        edge(width, depth, src, block);
    }
}

}  // namespace

void pack_a(bool trans, int64_t m, int64_t k, const BFloat16* a, int64_t lda, int64_t p0,
            int64_t p1, BFloat16* packed) {
  pack_panels(
      m, k, a, lda, !trans, p0, p1, packed,
      [&](const BFloat16* src, BFloat16* block) { full_a_block(trans, src, lda, block); },
      [&](int64_t rows, int64_t depth, const BFloat16* src, BFloat16* block) {
        pack_a_block(trans, rows, depth, src, lda, block);
      });
}

void pack_b(bool trans, int64_t k, int64_t n, const BFloat16* b, int64_t ldb, int64_t p0,
            int64_t p1, BFloat16* packed) {
  pack_panels(
      n, k, b, ldb, trans, p0, p1, packed,
      [&](const BFloat16* src, BFloat16* block) { full_b_block(trans, src, ldb, block); },
      [&](int64_t cols, int64_t depth, const BFloat16* src, BFloat16* block) {
        pack_b_block(trans, depth, cols, src, ldb, block);
      });
}

}  // namespace tessera::cpu::amx
