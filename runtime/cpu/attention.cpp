// Memory-efficient scaled-dot-product attention (FlashAttention's algorithm on
// the CPU). Forward: for each block of queries, walk the key blocks keeping a
// running row maximum and sum (online softmax), so only one Bq x Bk block of
// scores exists per thread. Backward: recompute each score block from Q, K
// and the saved logsumexp instead of storing the probabilities. The block
// products are small GEMMs (runtime/cpu/blas.h), one thread each inside the
// parallel loop. bf16 and f16 are computed in f32, widened a block or a head
// at a time (never a whole tensor), and rounded once. Operands are read, and
// outputs written, in the layouts runtime/ops_nn.cpp hands over (unit stride
// along head_dim, any other strides): no copies of q, k, v or the gradients.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "runtime/cpu/isa_copy.h"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/cpu/kernels_cpu.h"
#include "runtime/cpu/sums.h"
#include "runtime/kernels.h"
#include "runtime/parallel_for.h"

namespace tessera::cpu::TS_CPU_ISA {

namespace {

constexpr int64_t kBq = kAttentionBq;
constexpr int64_t kBk = kAttentionBk;

// Row-major C = alpha * op(A) op(B) + beta * C on one thread (runtime/cpu/blas.h
// runs single-threaded when called inside an OpenMP parallel region).
template <class T>
void block_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>)
    sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    dgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Number of keys query row i may see: all, or i + 1 when causal (top-left aligned).
inline int64_t visible_keys(int64_t i, int64_t s, bool causal) {
  return causal ? std::min(i + 1, s) : s;
}

// An operand [B, H, T, D] as the kernels read it: unit stride along D, any
// other strides (q, k and v may be views of one [B, T, 3C] projection, out
// and the gradients laid out [B, T, H, D]: runtime/ops_nn.cpp).
template <class S>
struct Heads {
  S* data;
  int64_t sb, sh, st;
  explicit Heads(const Tensor& x) : data(x.data<std::remove_const_t<S>>()), sb(x.stride(0)), sh(x.stride(1)), st(x.stride(2)) {}
  S* row(int64_t b, int64_t h, int64_t t) const { return data + b * sb + h * sh + t * st; }
};

// Widens rows x d elements of storage S (rows `ld` apart) into its compute
// type, packed: a block or a head of bf16/f16 at a time into the thread's
// scratch, never a whole tensor.
template <class S>
void widen(const S* src, int64_t rows, int64_t d, int64_t ld, Compute<S>* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < d; ++c) dst[i * d + c] = load(src[i * ld + c]);
}

// Rounds rows x d packed compute-type elements into storage S, rows `ld` apart.
template <class S>
void narrow_rows(const Compute<S>* src, int64_t rows, int64_t d, S* dst, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < d; ++c) dst[i * ld + c] = store<S>(src[i * d + c]);
}

template <class T>
void zero_rows(T* x, int64_t rows, int64_t d, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) std::fill(x + i * ld, x + i * ld + d, T(0));
}

// S is the storage type (f32, f64, or bf16/f16 computed in f32: T below); the
// 16-bit inputs are widened a block (forward) or a head (backward) at a time
// into per-thread scratch, so the products and the online softmax see the
// same f32 values as on a widened copy of the whole tensor, and the outputs
// are rounded once. f32 and f64 operands are read where they lie, each
// block product taking its rows' stride as its leading dimension.
template <class S>
void forward_typed(const ops::AttentionResult& r, const Tensor& qt, const Tensor& kt_,
                   const Tensor& vt, bool causal, double scale_d) {
  using T = Compute<S>;
  constexpr bool widened = !std::is_same_v<S, T>;
  int64_t b = qt.size(0), h = qt.size(1), t = qt.size(2), d = qt.size(3);
  int64_t hkv = kt_.size(1), s = kt_.size(2);
  int64_t group = h / hkv;
  const Heads<const S> q(qt), k(kt_), v(vt);
  const Heads<S> out(r.out);
  T* lse = r.lse.data<T>();
  T scale = static_cast<T>(scale_d);
  int64_t qblocks = (t + kBq - 1) / kBq;
  // Per-thread scratch, through the allocator (so memory_stats sees it): one
  // block of scores, the output accumulator, running max and sum (and the
  // widened Q, K and V blocks).
  const int64_t per_thread = attention_scratch_per_thread(d, widened);
  const int64_t rows = attention_scratch_rows(b * h * qblocks);
  Tensor scratch = empty({rows, per_thread}, r.lse.dtype());
  parallel_for(0, b * h * qblocks, 1, [&](int64_t w0, int64_t w1) {
    T* mine = scratch.data<T>() + detail::omp_thread_num() % rows * per_thread;
    T* sbuf = mine;
    T* acc = sbuf + kBq * kBk;
    T* m = acc + kBq * d;
    T* l = m + kBq;
    T* wide = l + kBq;  // widened: Q block, K block, V block
    for (int64_t w = w0; w < w1; ++w) {
      int64_t bh = w / qblocks, qb = w % qblocks;
      int64_t bi = bh / h, hi = bh % h, kvh = hi / group;
      int64_t i0 = qb * kBq, nq = std::min(kBq, t - i0);
      const T* qh;
      int64_t ldq = d, ldk = d, ldv = d;
      if constexpr (widened) {
        widen(q.row(bi, hi, i0), nq, d, q.st, wide);
        qh = wide;
      } else {
        qh = q.row(bi, hi, i0);
        ldq = q.st, ldk = k.st, ldv = v.st;
      }
      std::fill(m, m + kBq, -std::numeric_limits<T>::infinity());
      std::fill(l, l + kBq, T(0));
      std::fill(acc, acc + kBq * d, T(0));
      int64_t key_end = visible_keys(i0 + nq - 1, s, causal);
      for (int64_t j0 = 0; j0 < key_end; j0 += kBk) {
        int64_t nk = std::min(kBk, s - j0);
        const T *kb, *vb;
        if constexpr (widened) {
          widen(k.row(bi, kvh, j0), nk, d, k.st, wide + kBq * d);
          widen(v.row(bi, kvh, j0), nk, d, v.st, wide + (kBq + kBk) * d);
          kb = wide + kBq * d;
          vb = wide + (kBq + kBk) * d;
        } else {
          kb = k.row(bi, kvh, j0);
          vb = v.row(bi, kvh, j0);
        }
        // S = scale * Q_blk K_blk^T: the one block of scores this thread holds.
        block_gemm<T>(false, true, nq, nk, d, scale, qh, ldq, kb, ldk, T(0), sbuf, kBk);
        for (int64_t i = 0; i < nq; ++i) {
          T* si = sbuf + i * kBk;
          int64_t lim = std::max<int64_t>(0, std::min(nk, visible_keys(i0 + i, s, causal) - j0));
          T mx = lane_max(lim, m[i], [si](int64_t j) { return si[j]; });
          T corr = lim > 0 ? fast_exp(m[i] - mx) : T(1);
          for (int64_t j = 0; j < lim; ++j) si[j] = fast_exp(si[j] - mx);
          T rowsum = lane_sum<T>(lim, [si](int64_t j) { return si[j]; });
          for (int64_t j = lim; j < nk; ++j) si[j] = 0;  // masked keys contribute nothing
          l[i] = l[i] * corr + rowsum;
          m[i] = lim > 0 ? mx : m[i];
          if (corr != T(1)) {
            T* ai = acc + i * d;
            for (int64_t c = 0; c < d; ++c) ai[c] *= corr;
          }
        }
        // acc += P V_blk
        block_gemm<T>(false, false, nq, d, nk, T(1), sbuf, kBk, vb, ldv, T(1), acc, d);
      }
      for (int64_t i = 0; i < nq; ++i) {
        S* o = out.row(bi, hi, i0 + i);
        T inv = l[i] > T(0) ? T(1) / l[i] : T(0);  // a row that sees no key stays zero
        for (int64_t c = 0; c < d; ++c) o[c] = store<S>(acc[i * d + c] * inv);
        lse[bh * t + i0 + i] = l[i] > T(0) ? m[i] + std::log(l[i]) : -std::numeric_limits<T>::infinity();
      }
    }
  });
}

template <class S>
void backward_typed(const ops::AttentionGrads& g, const Tensor& dout_t, const Tensor& qt,
                    const Tensor& kt_, const Tensor& vt, const Tensor& out_t, const Tensor& lse_t,
                    bool causal, double scale_d) {
  using T = Compute<S>;
  constexpr bool widened = !std::is_same_v<S, T>;
  int64_t b = qt.size(0), h = qt.size(1), t = qt.size(2), d = qt.size(3);
  int64_t hkv = kt_.size(1), s = kt_.size(2);
  int64_t group = h / hkv;
  const Heads<const S> q(qt), k(kt_), v(vt), dout(dout_t), out(out_t);
  const Heads<S> dq(g.dq), dk(g.dk), dv(g.dv);
  const T* lse = lse_t.data<T>();
  T scale = static_cast<T>(scale_d);
  // One work item per (batch, kv head): it owns dK/dV of that head and dQ of
  // its query heads (widened: K, V, Q and dO of the head in f32, and f32
  // accumulators for dK, dV and dQ, rounded once at the end).
  const int64_t per_thread = attention_backward_scratch_per_thread(t, s, d, widened);
  const int64_t rows = attention_scratch_rows(b * hkv);
  Tensor scratch = empty({rows, per_thread}, lse_t.dtype());
  parallel_for(0, b * hkv, 1, [&](int64_t w0, int64_t w1) {
    T* p = scratch.data<T>() + detail::omp_thread_num() % rows * per_thread;
    T* dp = p + kBq * kBk;
    T* delta = dp + kBq * kBk;
    T* wide = delta + t;  // widened: K, V, dK, dV (s x d each), Q, dO, dQ (t x d each)
    for (int64_t w = w0; w < w1; ++w) {
      int64_t bi = w / hkv, kvh = w % hkv;
      const T *kh, *vh;
      T *dkh, *dvh;
      // Leading dimensions: packed d in the widened scratch, else each tensor's row stride.
      int64_t ldk = d, ldv = d, lddk = d, lddv = d;
      if constexpr (widened) {
        widen(k.row(bi, kvh, 0), s, d, k.st, wide);
        widen(v.row(bi, kvh, 0), s, d, v.st, wide + s * d);
        kh = wide;
        vh = wide + s * d;
        dkh = wide + 2 * s * d;
        dvh = wide + 3 * s * d;
      } else {
        kh = k.row(bi, kvh, 0), vh = v.row(bi, kvh, 0);
        dkh = dk.row(bi, kvh, 0), dvh = dv.row(bi, kvh, 0);
        ldk = k.st, ldv = v.st, lddk = dk.st, lddv = dv.st;
      }
      zero_rows(dkh, s, d, lddk);
      zero_rows(dvh, s, d, lddv);
      for (int64_t hi = kvh * group; hi < (kvh + 1) * group; ++hi) {
        int64_t bh = bi * h + hi;
        const S* os = out.row(bi, hi, 0);
        const T* lh = lse + bh * t;
        const T *qh, *doh;
        T* dqh;
        int64_t ldq = d, lddo = d, lddq = d;
        if constexpr (widened) {
          widen(q.row(bi, hi, 0), t, d, q.st, wide + 4 * s * d);
          widen(dout.row(bi, hi, 0), t, d, dout.st, wide + 4 * s * d + t * d);
          qh = wide + 4 * s * d;
          doh = wide + 4 * s * d + t * d;
          dqh = wide + 4 * s * d + 2 * t * d;
        } else {
          qh = q.row(bi, hi, 0), doh = dout.row(bi, hi, 0), dqh = dq.row(bi, hi, 0);
          ldq = q.st, lddo = dout.st, lddq = dq.st;
        }
        zero_rows(dqh, t, d, lddq);
        for (int64_t i = 0; i < t; ++i)  // delta_i = dO_i . O_i
          delta[i] = lane_sum<T>(d, [&](int64_t c) { return doh[i * lddo + c] * load(os[i * out.st + c]); });
        for (int64_t j0 = 0; j0 < s; j0 += kBk) {
          int64_t nk = std::min(kBk, s - j0);
          int64_t first_q = causal ? j0 / kBq * kBq : 0;  // earlier query blocks see none of these keys
          for (int64_t i0 = first_q; i0 < t; i0 += kBq) {
            int64_t nq = std::min(kBq, t - i0);
            const T* qb = qh + i0 * ldq;
            const T* dob = doh + i0 * lddo;
            // Recompute P = exp(scale * Q K^T - lse); dP = dO V^T.
            block_gemm<T>(false, true, nq, nk, d, scale, qb, ldq, kh + j0 * ldk, ldk, T(0), p, kBk);
            block_gemm<T>(false, true, nq, nk, d, T(1), dob, lddo, vh + j0 * ldv, ldv, T(0), dp, kBk);
            for (int64_t i = 0; i < nq; ++i) {
              T* pi = p + i * kBk;
              T* dpi = dp + i * kBk;
              int64_t lim = std::max<int64_t>(0, std::min(nk, visible_keys(i0 + i, s, causal) - j0));
              T li = lh[i0 + i], di = delta[i0 + i];
              for (int64_t j = 0; j < lim; ++j) {
                pi[j] = fast_exp(pi[j] - li);
                dpi[j] = pi[j] * (dpi[j] - di) * scale;  // dS, with the score scale folded in
              }
              for (int64_t j = lim; j < nk; ++j) pi[j] = dpi[j] = 0;
            }
            // dV += P^T dO;  dK += dS^T Q;  dQ += dS K.
            block_gemm<T>(true, false, nk, d, nq, T(1), p, kBk, dob, lddo, T(1), dvh + j0 * lddv, lddv);
            block_gemm<T>(true, false, nk, d, nq, T(1), dp, kBk, qb, ldq, T(1), dkh + j0 * lddk, lddk);
            block_gemm<T>(false, false, nq, d, nk, T(1), dp, kBk, kh + j0 * ldk, ldk, T(1), dqh + i0 * lddq, lddq);
          }
        }
        if constexpr (widened) narrow_rows(dqh, t, d, dq.row(bi, hi, 0), dq.st);
      }
      if constexpr (widened) {
        narrow_rows(dkh, s, d, dk.row(bi, kvh, 0), dk.st);
        narrow_rows(dvh, s, d, dv.row(bi, kvh, 0), dv.st);
      }
    }
  });
}

}  // namespace

void attention(const ops::AttentionResult& r, const Tensor& q, const Tensor& k, const Tensor& v,
               bool causal, double scale) {
  dispatch_floating(q.dtype(), "attention", [&](auto tag) {
    forward_typed<decltype(tag)>(r, q, k, v, causal, scale);
  });
}

void attention_backward(const ops::AttentionGrads& g, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        bool causal, double scale) {
  dispatch_floating(q.dtype(), "attention_backward", [&](auto tag) {
    backward_typed<decltype(tag)>(g, dout, q, k, v, out, lse, causal, scale);
  });
}

}  // namespace tessera::cpu::TS_CPU_ISA
