// The per-element math every backend's kernels share: the CPU compiles it as
// plain inline C++ (its tests exercise it), nvcc as __host__ __device__ code
// for the CUDA kernels. One definition of each op's formula, so the backends
// cannot drift apart: exp, tanh and erfc are the same polynomials on both.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "runtime/kernel_kinds.h"

#if defined(__CUDACC__)
#define TS_HD __host__ __device__
#define TS_INLINE __forceinline__
#else
#define TS_HD
// Force-inlined so that the CPU loops calling these vectorise.
#define TS_INLINE __attribute__((always_inline)) inline
#endif

namespace tessera::math {

TS_HD TS_INLINE float bits_to_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  std::memcpy(&f, &i, 4);
  return f;
#endif
}

// a * b + c, one rounding where the instruction set has FMA (two without).
// Written out where the compiler would otherwise choose: left to it, GCC
// fuses GELU's derivative (cdf + x * pdf) in a loop's scalar remainder and
// not in its vector body, so an element's bits depended on where a thread's
// piece of the loop began, and a fused kernel calling the same loop on other
// lengths (bias_gelu) could not give unary's bits.
template <class T>
TS_HD TS_INLINE T mul_add(T a, T b, T c) {
#if defined(__CUDA_ARCH__)
  return ::fma(a, b, c);  // CUDA's float and double overloads
#elif defined(__FMA__)
  return std::fma(a, b, c);  // the instruction (no errno: -fno-math-errno)
#else
  return a * b + c;
#endif
}

// Round to the nearest integer, ties to even (the default rounding mode).
TS_HD TS_INLINE float round_even(float x) {
#if defined(__CUDA_ARCH__)
  return ::rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// exp for f32 without branches, so loops of it vectorise: range reduction to
// r in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes coefficients, ~1 ulp),
// and 2^n applied as two normal powers of two (so results near FLT_MAX and
// denormal results are right). Underflows to 0 below -104; overflows to inf
// above ln(FLT_MAX); NaN propagates.
TS_HD TS_INLINE float fast_exp(float x) {
  // Ternaries, not fmin/fmax: those are library calls that block vectorisation.
  float xc = x < -104.0f ? -104.0f : (x > 88.72283905f ? 88.72283905f : x);
  float n = round_even(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t ni = static_cast<int32_t>(n);
  int32_t n1 = ni >> 1, n2 = ni - n1;
  float y = p * bits_to_float((n1 + 127) << 23) * bits_to_float((n2 + 127) << 23);
  y = x < -104.0f ? 0.0f : y;
  y = x > 88.72283905f ? INFINITY : y;
  return x != x ? x : y;
}
TS_HD TS_INLINE double fast_exp(double x) { return ::exp(x); }

// tanh: an odd polynomial near 0 (Cephes tanhf), 1 - 2/(e^{2|x|}+1) elsewhere.
TS_HD TS_INLINE float fast_tanh(float x) {
  float ax = ::fabsf(x);
  float z = x * x;
  float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                  1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  float e = fast_exp(2.0f * (ax < 9.0f ? ax : 9.0f));
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = ::copysignf(big, x);
  return ax < 0.625f ? small : big;
}
TS_HD TS_INLINE double fast_tanh(double x) { return ::tanh(x); }

TS_HD TS_INLINE float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }
TS_HD TS_INLINE double fast_sigmoid(double x) { return 1.0 / (1.0 + ::exp(-x)); }

// erfc with fractional error < 1.2e-7 everywhere (Numerical Recipes' erfcc).
TS_HD TS_INLINE float fast_erfc(float x) {
  float z = ::fabsf(x);
  float t = 1.0f / (1.0f + 0.5f * z);
  float p = -0.82215223f + t * 0.17087277f;
  p = 1.48851587f + t * p;
  p = -1.13520398f + t * p;
  p = 0.27886807f + t * p;
  p = -0.18628806f + t * p;
  p = 0.09678418f + t * p;
  p = 0.37409196f + t * p;
  p = 1.00002368f + t * p;
  float ans = t * fast_exp(-z * z - 1.26551223f + t * p);
  return x >= 0.0f ? ans : 2.0f - ans;
}
TS_HD TS_INLINE double fast_erfc(double x) { return ::erfc(x); }

// Standard normal CDF and density.
template <class T>
TS_HD TS_INLINE T normal_cdf(T x) {
  return T(0.5) * fast_erfc(-x * T(0.70710678118654752440));
}
template <class T>
TS_HD TS_INLINE T normal_pdf(T x) {
  return T(0.39894228040143267794) * fast_exp(T(-0.5) * x * x);
}

// The float math functions for T = float or double (the C names, which both
// host and device code have for each precision).
TS_HD TS_INLINE float m_log(float x) { return ::logf(x); }
TS_HD TS_INLINE double m_log(double x) { return ::log(x); }
TS_HD TS_INLINE float m_sqrt(float x) { return ::sqrtf(x); }
TS_HD TS_INLINE double m_sqrt(double x) { return ::sqrt(x); }
TS_HD TS_INLINE float m_abs(float x) { return ::fabsf(x); }
TS_HD TS_INLINE double m_abs(double x) { return ::fabs(x); }
TS_HD TS_INLINE float m_sin(float x) { return ::sinf(x); }
TS_HD TS_INLINE double m_sin(double x) { return ::sin(x); }
TS_HD TS_INLINE float m_cos(float x) { return ::cosf(x); }
TS_HD TS_INLINE double m_cos(double x) { return ::cos(x); }
TS_HD TS_INLINE float m_pow(float a, float b) { return ::powf(a, b); }
TS_HD TS_INLINE double m_pow(double a, double b) { return ::pow(a, b); }

// y = op(x).
template <class T>
TS_HD TS_INLINE T apply_unary(ops::UnaryOp op, T x) {
  using ops::UnaryOp;
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return fast_exp(x);
    case UnaryOp::Log: return m_log(x);
    case UnaryOp::Sqrt: return m_sqrt(x);
    case UnaryOp::Rsqrt: return T(1) / m_sqrt(x);
    case UnaryOp::Abs: return m_abs(x);
    case UnaryOp::Tanh: return fast_tanh(x);
    case UnaryOp::Sigmoid: return fast_sigmoid(x);
    case UnaryOp::Relu: return x < T(0) ? T(0) : x;  // std::max(x, 0): NaN stays NaN
    case UnaryOp::Gelu: return x * normal_cdf(x);
    case UnaryOp::GeluTanh: {
      // 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + e^{-2u}): one exp and
      // one division, and no 1 + tanh(u) to cancel where u is negative (that
      // form kept no correct digit below x = -5 in f32).
      const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
      return x / (T(1) + fast_exp(T(-2) * u));
    }
    case UnaryOp::Silu: return x * fast_sigmoid(x);
    case UnaryOp::Sin: return m_sin(x);
    case UnaryOp::Cos: return m_cos(x);
    case UnaryOp::Square: return x * x;
    case UnaryOp::Reciprocal: return T(1) / x;
    case UnaryOp::Sign: return T((x > T(0)) - (x < T(0)));
  }
  return x;
}

// The gradient of op at x (y = op(x)), times g.
template <class T>
TS_HD TS_INLINE T apply_unary_backward(ops::UnaryOp op, T g, T x, T y) {
  using ops::UnaryOp;
  switch (op) {
    case UnaryOp::Neg: return -g;
    case UnaryOp::Exp: return g * y;
    case UnaryOp::Log: return g / x;
    case UnaryOp::Sqrt: return g / (T(2) * y);
    case UnaryOp::Rsqrt: return T(-0.5) * g * y * y * y;
    case UnaryOp::Abs: return x > T(0) ? g : (x < T(0) ? -g : T(0));
    case UnaryOp::Tanh: return g * (T(1) - y * y);
    case UnaryOp::Sigmoid: return g * y * (T(1) - y);
    case UnaryOp::Relu: return x > T(0) ? g : T(0);
    case UnaryOp::Gelu: return g * mul_add(x, normal_pdf(x), normal_cdf(x));
    case UnaryOp::GeluTanh: {
      // d/dx x s(2u) = s + 2 x u' s (1 - s), s = 1 / (1 + e), e = e^{-2u}. For
      // u >= 0, 1 - s is taken as e s (no cancellation as s nears 1); for u < 0
      // as 1 - s (e may be infinite there, and s is 0).
      const T k = T(0.79788456080286535588);
      const T x2 = x * x;
      const T u = k * (x + T(0.044715) * x2 * x);
      const T e = fast_exp(T(-2) * u);
      const T s = T(1) / (T(1) + e);
      const T rest = u < T(0) ? T(1) - s : e * s;
      const T du = k * (T(1) + T(3) * T(0.044715) * x2);
      return g * (s + T(2) * x * du * s * rest);
    }
    case UnaryOp::Silu: {
      T s = fast_sigmoid(x);
      return g * (s + x * s * (T(1) - s));
    }
    case UnaryOp::Sin: return g * m_cos(x);
    case UnaryOp::Cos: return -g * m_sin(x);
    case UnaryOp::Square: return T(2) * g * x;
    case UnaryOp::Reciprocal: return -g * y * y;
    case UnaryOp::Sign: return T(0);
  }
  return g;
}

// a op b for the arithmetic ops (NaN-propagating maximum/minimum, as PyTorch).
template <class T>
TS_HD TS_INLINE T apply_binary(ops::BinaryOp op, T a, T b) {
  using ops::BinaryOp;
  if constexpr (std::is_same_v<T, bool>) {  // the ops layer allows only max/min on bool
    return op == BinaryOp::Maximum ? (a || b) : (a && b);
  } else {
    switch (op) {
      case BinaryOp::Add: return a + b;
      case BinaryOp::Sub: return a - b;
      case BinaryOp::Mul: return a * b;
      case BinaryOp::Div: return a / b;
      case BinaryOp::Pow:
        if constexpr (std::is_floating_point_v<T>) return m_pow(a, b);
        else return static_cast<T>(m_pow(static_cast<double>(a), static_cast<double>(b)));
      case BinaryOp::Maximum: return (a != a || a > b) ? a : b;
      case BinaryOp::Minimum: return (a != a || a < b) ? a : b;
      default: return T(0);
    }
  }
}

template <class T>
TS_HD TS_INLINE bool apply_compare(ops::BinaryOp op, T a, T b) {
  using ops::BinaryOp;
  switch (op) {
    case BinaryOp::Eq: return a == b;
    case BinaryOp::Ne: return a != b;
    case BinaryOp::Lt: return a < b;
    case BinaryOp::Le: return a <= b;
    case BinaryOp::Gt: return a > b;
    case BinaryOp::Ge: return a >= b;
    default: return false;
  }
}

TS_HD TS_INLINE bool is_compare(ops::BinaryOp op) { return op >= ops::BinaryOp::Eq; }

// One step of an in-place update of x by (a, b) with scale c.
template <PointwiseOp Op, class T>
TS_HD TS_INLINE void apply_pointwise(T& x, T a, T b, T c) {
  if constexpr (Op == PointwiseOp::AddScaled) x += c * a;
  else if constexpr (Op == PointwiseOp::Addcmul) x += c * a * b;
  else if constexpr (Op == PointwiseOp::Addcdiv) x += c * a / b;
  else x += c * (a - x);  // Lerp
}

// ---- AdamW ----------------------------------------------------------------------

// One AdamW step's constants, in the compute type C.
template <class C>
struct AdamWConstants {
  C decay;            // 1 - lr * weight_decay
  C one_minus_beta1;  // the first moment's lerp weight
  C beta2, one_minus_beta2;
  C inv_sqrt_bias2;   // 1 / sqrt(1 - beta2^step)
  C eps;
  C neg_step_size;    // -lr / (1 - beta1^step)
};

template <class C>
inline AdamWConstants<C> adamw_constants(const ops::AdamWStep& s) {
  double bias1 = 1.0 - ::pow(s.beta1, static_cast<double>(s.step));
  double bias2 = 1.0 - ::pow(s.beta2, static_cast<double>(s.step));
  return {C(1.0 - s.lr * s.weight_decay), C(1.0 - s.beta1), C(s.beta2), C(1.0 - s.beta2),
          C(1.0 / ::sqrt(bias2)), C(s.eps), C(-s.lr / bias1)};
}

// One element of AdamW (decoupled weight decay), the unfused ops' steps in
// their order (nn/optim.cpp): decay p; m = lerp(m, g, 1 - beta1);
// v = beta2 v + (1 - beta2) g^2; p -= lr / bias1 * m / (sqrt(v / bias2) + eps).
// Equal to the unfused ops to rounding, not bit for bit: a compiler may fuse a
// multiply and an add here into one FMA (the AVX2/AVX-512 copies, CUDA), and
// bf16/f16 values stay in f32 between the steps instead of rounding after each.
template <class C>
TS_HD TS_INLINE void adamw_update(C& p, C g, C& m, C& v, const AdamWConstants<C>& k) {
  p *= k.decay;
  m += k.one_minus_beta1 * (g - m);
  v *= k.beta2;
  v += k.one_minus_beta2 * g * g;
  C denom = m_sqrt(v) * k.inv_sqrt_bias2 + k.eps;
  p += k.neg_step_size * m / denom;
}

// ---- counter-based random numbers (runtime/random.h) ---------------------------

// Philox 4x32-10 of counter c under key k, in place.
TS_HD TS_INLINE void philox4x32(uint32_t c[4], uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, n1 = static_cast<uint32_t>(p1);
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1, n3 = static_cast<uint32_t>(p0);
    c[0] = n0, c[1] = n1, c[2] = n2, c[3] = n3;
    k0 += kW0;
    k1 += kW1;
  }
}

// Two uniforms in [0, 1) with 53 random bits each, from the Philox block of
// `counter` under the key (seed, stream).
TS_HD TS_INLINE void draw_uniforms(uint64_t seed, uint64_t stream, uint64_t counter, double& u0,
                                   double& u1) {
  uint32_t c[4] = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                   static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)};
  philox4x32(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  constexpr double k53 = 1.0 / 9007199254740992.0;
  u0 = static_cast<double>((static_cast<uint64_t>(c[0] >> 5) << 26) | (c[1] >> 6)) * k53;
  u1 = static_cast<double>((static_cast<uint64_t>(c[2] >> 5) << 26) | (c[3] >> 6)) * k53;
}

// Each product and sum rounded on its own, as the CPU build computes them:
// nvcc would fuse a product and the sum after it into one FMA, rounded once,
// and a GPU's f64 draws would differ from the CPU's in the last bit.
TS_HD TS_INLINE double uniform_value(double u0, double low, double high) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(low, __dmul_rn(high - low, u0));
#else
  return low + (high - low) * u0;
#endif
}

// Box-Muller on (u0, u1); 1 - u0 is in (0, 1].
TS_HD TS_INLINE double normal_value(double u0, double u1, double mean, double std) {
  double radius = ::sqrt(-2.0 * ::log(1.0 - u0));
#ifdef __CUDA_ARCH__
  return __dadd_rn(mean, __dmul_rn(__dmul_rn(std, radius), ::cos(6.283185307179586 * u1)));
#else
  return mean + std * radius * ::cos(6.283185307179586 * u1);
#endif
}

}  // namespace tessera::math
