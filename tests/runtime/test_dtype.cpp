#include <cmath>
#include <cstring>
#include <limits>

#include "tests/helpers.h"

using namespace tessera;

namespace {
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// Reference: round a float to the nearest value representable with `mant_bits`
// mantissa bits, ties to even, by exhaustive comparison of the two neighbours.
double nearest_even(double v, double lo, double hi, bool lo_even) {
  double dl = v - lo, dh = hi - v;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return lo_even ? lo : hi;
}

// The f16 conversions as they were written first, with branches, one case at
// a time: the reference for the branch-free ones in runtime/dtype.h.
uint16_t reference_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value = mantissa * 2^-24. Round the shifted mantissa.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp) ... brings mant into 2^-24 units
    uint32_t half_units = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_units & 1u))) half_units++;
    return static_cast<uint16_t>(sign | half_units);
  }
  // Normal: rebias exponent (127 -> 15) and round mantissa from 23 to 10 bits.
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  uint32_t h = (rounded - 0x38000000u) >> 13;
  return static_cast<uint16_t>(sign | h);
}

float reference_from_f16(Half h) {
  uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        e++;
      } while ((mant & 0x400u) == 0);
      out = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}
}  // namespace

TEST_CASE("bf16 conversion rounds to nearest even", "[dtype]") {
  // Exhaustive over every bf16 interval boundary region is too big; sample all
  // mantissa patterns of the dropped half for several exponents and signs.
  for (uint32_t hi : {0x3f80u, 0x4049u, 0x0001u, 0xc2f7u, 0x7f7eu, 0x0080u}) {
    for (uint32_t low = 0; low < 0x10000u; low += 7) {
      uint32_t bits = (hi << 16) | low;
      float f = from_bits(bits);
      BFloat16 b = float_to_bf16(f);
      double lo_v = bf16_to_float(BFloat16{static_cast<uint16_t>(hi)});
      double hi_v = bf16_to_float(BFloat16{static_cast<uint16_t>(hi + 1)});
      double expect = nearest_even(std::fabs(f), std::fabs(lo_v), std::fabs(hi_v), (hi & 1u) == 0);
      REQUIRE(std::fabs(bf16_to_float(b)) == expect);
    }
  }
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
  CHECK(bf16_to_float(float_to_bf16(3.4e38f)) == std::numeric_limits<float>::infinity());
  CHECK(bf16_to_float(float_to_bf16(-0.0f)) == 0.0f);
  CHECK(std::signbit(bf16_to_float(float_to_bf16(-0.0f))));
}

TEST_CASE("f16 conversion matches round-to-nearest-even on every half value", "[dtype]") {
  // Every finite f16 value round-trips; midpoints between neighbours tie to even.
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    float v = f16_to_float(Half{static_cast<uint16_t>(h)});
    REQUIRE(float_to_f16(v).bits == h);
    REQUIRE(float_to_f16(-v).bits == (h | 0x8000u));
    if (h + 1 < 0x7c00u) {
      float next = f16_to_float(Half{static_cast<uint16_t>(h + 1)});
      float mid = static_cast<float>((static_cast<double>(v) + next) / 2);
      uint16_t even = (h & 1u) == 0 ? static_cast<uint16_t>(h) : static_cast<uint16_t>(h + 1);
      REQUIRE(float_to_f16(mid).bits == even);
      // Just above/below the midpoint goes to the nearer neighbour.
      REQUIRE(float_to_f16(std::nextafter(mid, 1e9f)).bits == h + 1);
      REQUIRE(float_to_f16(std::nextafter(mid, -1e9f)).bits == h);
    }
  }
  CHECK(float_to_f16(65520.0f).bits == 0x7c00u);  // rounds to inf
  CHECK(float_to_f16(65519.0f).bits == 0x7bffu);
  CHECK(f16_to_float(Half{0x0001u}) == std::ldexp(1.0f, -24));
  CHECK(float_to_f16(std::ldexp(1.0f, -25)).bits == 0);  // tie between 0 and 2^-24 -> even (0)
  CHECK(std::isnan(f16_to_float(float_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  (void)to_bits;
}

TEST_CASE("the branch-free f16 conversions give the reference's bits", "[dtype]") {
  // Every half (NaN payloads included), and every 257th f32 bit pattern plus
  // every pattern around the classes' edges (subnormal results, the largest
  // finite, inf, NaN) in both signs. Every f32 pattern agreed when written.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const Half half{static_cast<uint16_t>(h)};
    REQUIRE(to_bits(f16_to_float(half)) == to_bits(reference_from_f16(half)));
  }
  auto check = [](uint32_t u) {
    const float f = from_bits(u);
    if (float_to_f16(f).bits != reference_to_f16(f)) {
      INFO("f32 bits " << u);
      REQUIRE(float_to_f16(f).bits == reference_to_f16(f));
    }
  };
  for (uint64_t u = 0; u <= 0xffffffffull; u += 257) check(static_cast<uint32_t>(u));
  for (uint32_t edge : {0x33000000u, 0x38800000u, 0x477ff000u, 0x47800000u, 0x7f800000u})
    for (uint32_t d = 0; d < 4096; ++d)
      for (uint32_t sign : {0u, 0x80000000u}) {
        check(sign | (edge + d));
        check(sign | (edge - d));
      }
}

TEST_CASE("dtype names and sizes", "[dtype]") {
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::Bool})
    CHECK(dtype_from_name(dtype_name(dt)) == dt);
  CHECK(dtype_size(DType::BF16) == 2);
  CHECK(dtype_size(DType::I64) == 8);
  CHECK_THROWS_WITH(dtype_from_name("f8"), Catch::Contains("unknown dtype 'f8'"));
}

TEST_CASE("tensor dtype conversion uses the same rounding", "[dtype]") {
  Tensor x = randn({257}, 3, DType::F32);
  Tensor b = ops::to(x, DType::BF16);
  Tensor h = ops::to(x, DType::F16);
  auto vx = x.to_vector<float>(), vb = b.to_vector<float>(), vh = h.to_vector<float>();
  for (size_t i = 0; i < vx.size(); ++i) {
    CHECK(vb[i] == bf16_to_float(float_to_bf16(vx[i])));
    CHECK(vh[i] == f16_to_float(float_to_f16(vx[i])));
  }
  // Contiguous (a vectorised loop, split across threads when long) and
  // strided conversions, with the special values: ties, NaN, infinities,
  // subnormals, values that round up to infinity.
  std::vector<float> special{0.0f, -0.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, INFINITY, -INFINITY, NAN,
                             -NAN, 1e-40f, -3e-39f, 3.4e38f, 65519.0f, 65520.0f, 6e-8f, 1.0f / 3};
  std::vector<float> values = randn({70001}, 4).to_vector<float>();
  values.insert(values.end(), special.begin(), special.end());
  Tensor big = from_vector(values, {static_cast<int64_t>(values.size())});
  Tensor strided = ops::transpose(ops::reshape(ops::narrow(big, 0, 0, 70000), {350, 200}), 0, 1);
  for (const Tensor& src : {big, strided}) {
    std::vector<float> in = ops::contiguous(src).to_vector<float>();
    std::vector<uint16_t> want_b(in.size()), want_h(in.size());
    for (size_t k = 0; k < in.size(); ++k) {
      want_b[k] = float_to_bf16(in[k]).bits;
      want_h[k] = float_to_f16(in[k]).bits;
    }
    Tensor tb = ops::contiguous(ops::to(src, DType::BF16)), th = ops::contiguous(ops::to(src, DType::F16));
    CHECK(std::memcmp(tb.data_ptr(), want_b.data(), want_b.size() * 2) == 0);
    CHECK(std::memcmp(th.data_ptr(), want_h.data(), want_h.size() * 2) == 0);
    // And back: every bf16/f16 value is exact in f32.
    std::vector<float> back_b = ops::to(tb, DType::F32).to_vector<float>();
    std::vector<float> back_h = ops::to(th, DType::F32).to_vector<float>();
    for (size_t k = 0; k < in.size(); ++k) {
      INFO(k);
      uint32_t wb = static_cast<uint32_t>(want_b[k]) << 16, gb;
      std::memcpy(&gb, &back_b[k], 4);
      CHECK(gb == wb);
      float wh = f16_to_float(Half{want_h[k]});
      CHECK(std::memcmp(&back_h[k], &wh, 4) == 0);
    }
  }
  Tensor i = ops::to(from_vector<float>({-2.7f, 0.5f, 3.9f}, {3}), DType::I64);
  CHECK(i.to_vector<int64_t>() == std::vector<int64_t>{-2, 0, 3});
}
