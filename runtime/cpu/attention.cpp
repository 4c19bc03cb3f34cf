// Memory-efficient scaled-dot-product attention (FlashAttention's algorithm on
// the CPU). Forward: for each block of queries, walk the key blocks keeping a
// running row maximum and sum (online softmax), so only one Bq x Bk block of
// scores exists per thread. Backward: recompute each score block from Q, K
// and the saved logsumexp instead of storing the probabilities.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "runtime/cpu/dispatch.h"
#include "runtime/kernels.h"
#include "runtime/parallel.h"

namespace tessera::cpu {

namespace {

constexpr int64_t kBq = 64;  // queries per block
constexpr int64_t kBk = 64;  // keys per block

// s[i][j] = scale * sum_d q[i][d] * kt[d][j]   (kt: a key block transposed, [D][nk])
template <class T>
void scores_block(T* s, const T* q, const T* kt, int64_t nq, int64_t nk, int64_t d, T scale) {
  for (int64_t i = 0; i < nq; ++i) {
    T* si = s + i * kBk;
    for (int64_t j = 0; j < nk; ++j) si[j] = 0;
    const T* qi = q + i * d;
    for (int64_t c = 0; c < d; ++c) {
      T a = qi[c] * scale;
      const T* kr = kt + c * kBk;
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) si[j] += a * kr[j];
    }
  }
}

// Copies rows [j0, j0+nk) of a [S][D] matrix into dst[D][kBk] (transposed).
template <class T>
void transpose_block(T* dst, const T* src, int64_t j0, int64_t nk, int64_t d) {
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t c = 0; c < d; ++c) dst[c * kBk + j] = src[(j0 + j) * d + c];
}

// Number of keys query row i may see: all, or i + 1 when causal (top-left aligned).
inline int64_t visible_keys(int64_t i, int64_t s, bool causal) {
  return causal ? std::min(i + 1, s) : s;
}

template <class T>
void forward_typed(const ops::AttentionResult& r, const Tensor& qt, const Tensor& kt_,
                   const Tensor& vt, bool causal, double scale_d) {
  int64_t b = qt.size(0), h = qt.size(1), t = qt.size(2), d = qt.size(3);
  int64_t hkv = kt_.size(1), s = kt_.size(2);
  int64_t group = h / hkv;
  const T* q = qt.data<T>();
  const T* k = kt_.data<T>();
  const T* v = vt.data<T>();
  T* out = r.out.data<T>();
  T* lse = r.lse.data<T>();
  T scale = static_cast<T>(scale_d);
  int64_t qblocks = (t + kBq - 1) / kBq;
  parallel_for(0, b * h * qblocks, 1, [&](int64_t w0, int64_t w1) {
    std::vector<T> sbuf(kBq * kBk), ktb(static_cast<size_t>(d * kBk)), acc(kBq * d);
    std::vector<T> m(kBq), l(kBq);
    for (int64_t w = w0; w < w1; ++w) {
      int64_t bh = w / qblocks, qb = w % qblocks;
      int64_t bi = bh / h, hi = bh % h, kvh = hi / group;
      int64_t i0 = qb * kBq, nq = std::min(kBq, t - i0);
      const T* qh = q + (bh * t + i0) * d;
      const T* kh = k + (bi * hkv + kvh) * s * d;
      const T* vh = v + (bi * hkv + kvh) * s * d;
      std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
      std::fill(l.begin(), l.end(), T(0));
      std::fill(acc.begin(), acc.end(), T(0));
      int64_t key_end = visible_keys(i0 + nq - 1, s, causal);
      for (int64_t j0 = 0; j0 < key_end; j0 += kBk) {
        int64_t nk = std::min(kBk, s - j0);
        transpose_block(ktb.data(), kh, j0, nk, d);
        scores_block(sbuf.data(), qh, ktb.data(), nq, nk, d, scale);
        for (int64_t i = 0; i < nq; ++i) {
          T* si = sbuf.data() + i * kBk;
          int64_t lim = std::min(nk, visible_keys(i0 + i, s, causal) - j0);  // keys j0..j0+lim
          if (lim <= 0) continue;
          T mx = m[i];
          for (int64_t j = 0; j < lim; ++j) mx = std::max(mx, si[j]);
          T corr = fast_exp(m[i] - mx);
          T rowsum = 0;
          for (int64_t j = 0; j < lim; ++j) {
            si[j] = fast_exp(si[j] - mx);
            rowsum += si[j];
          }
          l[i] = l[i] * corr + rowsum;
          m[i] = mx;
          T* ai = acc.data() + i * d;
          for (int64_t c = 0; c < d; ++c) ai[c] *= corr;
          for (int64_t j = 0; j < lim; ++j) {
            T p = si[j];
            const T* vr = vh + (j0 + j) * d;
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) ai[c] += p * vr[c];
          }
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        T* o = out + (bh * t + i0 + i) * d;
        // A row that sees no key (only possible with t > s non-causal? never) stays zero.
        T inv = l[i] > T(0) ? T(1) / l[i] : T(0);
        for (int64_t c = 0; c < d; ++c) o[c] = acc[i * d + c] * inv;
        lse[bh * t + i0 + i] = l[i] > T(0) ? m[i] + std::log(l[i])
                                           : -std::numeric_limits<T>::infinity();
      }
    }
  });
}

template <class T>
void backward_typed(const ops::AttentionGrads& g, const Tensor& dout_t, const Tensor& qt,
                    const Tensor& kt_, const Tensor& vt, const Tensor& out_t, const Tensor& lse_t,
                    bool causal, double scale_d) {
  int64_t b = qt.size(0), h = qt.size(1), t = qt.size(2), d = qt.size(3);
  int64_t hkv = kt_.size(1), s = kt_.size(2);
  int64_t group = h / hkv;
  const T *q = qt.data<T>(), *k = kt_.data<T>(), *v = vt.data<T>();
  const T *dout = dout_t.data<T>(), *out = out_t.data<T>(), *lse = lse_t.data<T>();
  T *dq = g.dq.data<T>(), *dk = g.dk.data<T>(), *dv = g.dv.data<T>();
  T scale = static_cast<T>(scale_d);
  // One work item per (batch, kv head): it owns dK/dV of that head and dQ of its query heads.
  parallel_for(0, b * hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<T> p(kBq * kBk), dp(kBq * kBk), ktb(static_cast<size_t>(d * kBk)),
        vtb(static_cast<size_t>(d * kBk)), delta(static_cast<size_t>(t));
    for (int64_t w = w0; w < w1; ++w) {
      int64_t bi = w / hkv, kvh = w % hkv;
      const T* kh = k + w * s * d;
      const T* vh = v + w * s * d;
      T* dkh = dk + w * s * d;
      T* dvh = dv + w * s * d;
      std::fill(dkh, dkh + s * d, T(0));
      std::fill(dvh, dvh + s * d, T(0));
      for (int64_t hi = kvh * group; hi < (kvh + 1) * group; ++hi) {
        int64_t bh = bi * h + hi;
        const T* qh = q + bh * t * d;
        const T* doh = dout + bh * t * d;
        const T* oh = out + bh * t * d;
        const T* lh = lse + bh * t;
        T* dqh = dq + bh * t * d;
        std::fill(dqh, dqh + t * d, T(0));
        for (int64_t i = 0; i < t; ++i) {
          T acc = 0;
          for (int64_t c = 0; c < d; ++c) acc += doh[i * d + c] * oh[i * d + c];
          delta[i] = acc;
        }
        for (int64_t j0 = 0; j0 < s; j0 += kBk) {
          int64_t nk = std::min(kBk, s - j0);
          transpose_block(ktb.data(), kh, j0, nk, d);
          transpose_block(vtb.data(), vh, j0, nk, d);
          int64_t first_q = causal ? j0 / kBq * kBq : 0;  // earlier query blocks see none of these keys
          for (int64_t i0 = first_q; i0 < t; i0 += kBq) {
            int64_t nq = std::min(kBq, t - i0);
            const T* qb = qh + i0 * d;
            const T* dob = doh + i0 * d;
            scores_block(p.data(), qb, ktb.data(), nq, nk, d, scale);
            scores_block(dp.data(), dob, vtb.data(), nq, nk, d, T(1));
            for (int64_t i = 0; i < nq; ++i) {
              T* pi = p.data() + i * kBk;
              T* dpi = dp.data() + i * kBk;
              int64_t lim = std::min(nk, visible_keys(i0 + i, s, causal) - j0);
              if (lim < 0) lim = 0;
              T li = lh[i0 + i];
              for (int64_t j = 0; j < lim; ++j) {
                pi[j] = fast_exp(pi[j] - li);
                dpi[j] = pi[j] * (dpi[j] - delta[i0 + i]) * scale;  // dS, scaled
              }
              const T* doi = dob + i * d;
              const T* qi = qb + i * d;
              T* dqi = dqh + (i0 + i) * d;
              for (int64_t j = 0; j < lim; ++j) {
                T pj = pi[j], ds = dpi[j];
                T* dvr = dvh + (j0 + j) * d;
                T* dkr = dkh + (j0 + j) * d;
                const T* kr = kh + (j0 + j) * d;
#pragma omp simd
                for (int64_t c = 0; c < d; ++c) {
                  dvr[c] += pj * doi[c];
                  dkr[c] += ds * qi[c];
                  dqi[c] += ds * kr[c];
                }
              }
            }
          }
        }
      }
    }
  });
}

}  // namespace

void attention(const ops::AttentionResult& r, const Tensor& q, const Tensor& k, const Tensor& v,
               bool causal, double scale) {
  dispatch_float(q.dtype(), "attention", [&](auto tag) {
    forward_typed<decltype(tag)>(r, q, k, v, causal, scale);
  });
}

void attention_backward(const ops::AttentionGrads& g, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        bool causal, double scale) {
  dispatch_float(q.dtype(), "attention_backward", [&](auto tag) {
    backward_typed<decltype(tag)>(g, dout, q, k, v, out, lse, causal, scale);
  });
}

}  // namespace tessera::cpu
