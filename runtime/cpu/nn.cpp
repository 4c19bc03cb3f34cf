// Fused neural-network kernels over rows of the last dim: softmax, layer/RMS
// norm (with a residual add before it or not), embedding, cross-entropy,
// rotary embedding. Softmax, the norms and cross-entropy take bf16/f16 as
// they are: each element is read into an f32 register and each result
// rounded once on store, so they equal the f32 kernel on a widened copy
// rounded afterwards, bit for bit, without the copy (the norms' statistics
// and the per-row losses stay f32). RoPE computes on f32 copies (its cos/sin
// tables would be rounded to bf16 otherwise).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "runtime/cpu/isa_copy.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/cpu/sums.h"
#include "runtime/kernels.h"
#include "runtime/parallel_for.h"

namespace tessera::cpu::TS_CPU_ISA {

namespace {
int64_t rows_of(const Tensor& x) {
  int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  return n == 0 ? 0 : x.numel() / n;
}
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)); }
}  // namespace

void softmax(const Tensor& out, const Tensor& x, bool log) {
  int64_t rows = rows_of(x), n = x.size(-1);
  dispatch_floating(x.dtype(), log ? "log_softmax" : "softmax", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    const S* px = x.data<S>();
    S* po = out.data<S>();
    parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const S* xr = px + r * n;
        S* o = po + r * n;
        T m = lane_max(n, -std::numeric_limits<T>::infinity(), [xr](int64_t j) { return load(xr[j]); });
        if (m == -std::numeric_limits<T>::infinity()) m = 0;  // all -inf: avoid inf - inf
        T sum;
        if constexpr (std::is_same_v<S, T>) {  // the exponentials kept in the output
          for (int64_t j = 0; j < n; ++j) o[j] = fast_exp(xr[j] - m);
          sum = lane_sum<T>(n, [o](int64_t j) { return o[j]; });
        } else {  // computed twice rather than rounded in between
          sum = lane_sum<T>(n, [xr, m](int64_t j) { return fast_exp(load(xr[j]) - m); });
        }
        if (log) {
          T lse = m + std::log(sum);
          for (int64_t j = 0; j < n; ++j) o[j] = store<S>(load(xr[j]) - lse);
        } else {
          T inv = T(1) / sum;
          if constexpr (std::is_same_v<S, T>)
            for (int64_t j = 0; j < n; ++j) o[j] *= inv;
          else
            for (int64_t j = 0; j < n; ++j) o[j] = store<S>(fast_exp(load(xr[j]) - m) * inv);
        }
      }
    });
  });
}

void softmax_backward(const Tensor& gx, const Tensor& gy, const Tensor& y, bool log) {
  int64_t rows = rows_of(y), n = y.size(-1);
  dispatch_floating(y.dtype(), "softmax_backward", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    const S* pg = gy.data<S>();
    const S* py = y.data<S>();
    S* po = gx.data<S>();
    parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const S* g = pg + r * n;
        const S* yr = py + r * n;
        S* o = po + r * n;
        if (log) {
          T dot = static_cast<T>(
              lane_sum<double>(n, [g](int64_t j) { return static_cast<double>(load(g[j])); }));
          for (int64_t j = 0; j < n; ++j) o[j] = store<S>(load(g[j]) - fast_exp(load(yr[j])) * dot);
        } else {
          T dot = static_cast<T>(lane_sum<double>(n, [g, yr](int64_t j) {
            return static_cast<double>(load(g[j])) * static_cast<double>(load(yr[j]));
          }));
          for (int64_t j = 0; j < n; ++j) o[j] = store<S>(load(yr[j]) * (load(g[j]) - dot));
        }
      }
    });
  });
}

namespace {
// The norm of each row of x; with a residual, of each row of x + residual,
// which is first written to `sum` (rounded as add rounds it) and normalised
// from there while it is in cache: the bits of add, then the norm.
void norm_rows(const ops::NormResult& res, const Tensor& sum, const Tensor& x, const Tensor& residual,
               const Tensor& w, const Tensor& b, double eps, bool rms, const char* name) {
  int64_t rows = rows_of(x), n = x.size(-1);
  dispatch_floating(x.dtype(), name, [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    const S* px = x.data<S>();
    const S* pres = residual.defined() ? residual.data<S>() : nullptr;
    S* psum = residual.defined() ? sum.data<S>() : nullptr;
    const S* pw = w.defined() ? w.data<S>() : nullptr;
    const S* pb = b.defined() ? b.data<S>() : nullptr;
    S* py = res.y.data<S>();
    T* pmean = rms ? nullptr : res.mean.data<T>();
    T* prstd = res.rstd.data<T>();
    parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const S* xr = px + r * n;
        S* yr = py + r * n;
        auto square = [](double d) { return d * d; };
        // The mean (RMS's mean square) of the row; with a residual, of the
        // sum. In f32 and f64 the sum is written as it is made and summed in
        // the same pass (in lane_sum's order either way, so the same bits);
        // bf16 and f16 sums are written first, in a loop of their own (their
        // rounding inside lane_sum's loop ran 2x slower than the two ops,
        // bench_kernels), and summed from cache.
        double mean = 0, var = 0;
        bool have_mean = rms, have_var = false;  // RMS: the mean is taken as 0
        if (pres) {
          const S* rr = pres + r * n;
          S* sr = psum + r * n;
          if constexpr (std::is_same_v<S, T>) {
            auto sum_at = [xr, rr, sr](int64_t j) {
              const S v = xr[j] + rr[j];
              sr[j] = v;
              return static_cast<double>(v);
            };
            if (rms) {
              var = lane_sum<double>(n, [&](int64_t j) { return square(sum_at(j)); }) / static_cast<double>(n);
              have_var = true;
            } else {
              mean = lane_sum<double>(n, sum_at) / static_cast<double>(n);
              have_mean = true;
            }
          } else {
            for (int64_t j = 0; j < n; ++j) sr[j] = store<S>(load(xr[j]) + load(rr[j]));
          }
          xr = sr;
        }
        if (!have_mean)
          mean = lane_sum<double>(n, [xr](int64_t j) { return static_cast<double>(load(xr[j])); }) /
                 static_cast<double>(n);
        if (!have_var)
          var = lane_sum<double>(n, [xr, mean, square](int64_t j) {
                  return square(static_cast<double>(load(xr[j])) - mean);
                }) /
                static_cast<double>(n);
        T rstd = static_cast<T>(1.0 / std::sqrt(var + eps));
        T m = static_cast<T>(mean);
        if (pmean) pmean[r] = m;
        prstd[r] = rstd;
        for (int64_t j = 0; j < n; ++j) {
          T v = (load(xr[j]) - m) * rstd;
          if (pw) v *= load(pw[j]);
          if (pb) v += load(pb[j]);
          yr[j] = store<S>(v);
        }
      }
    });
  });
}
}  // namespace

void layer_norm(const ops::NormResult& res, const Tensor& x, const Tensor& w, const Tensor& b,
                double eps, bool rms) {
  norm_rows(res, Tensor(), x, Tensor(), w, b, eps, rms, rms ? "rms_norm" : "layer_norm");
}

void add_layer_norm(const ops::NormResult& res, const Tensor& sum, const Tensor& x, const Tensor& residual,
                    const Tensor& w, const Tensor& b, double eps, bool rms) {
  norm_rows(res, sum, x, residual, w, b, eps, rms, rms ? "add_rms_norm" : "add_layer_norm");
}

void layer_norm_backward(const ops::NormGrads& g, const Tensor& dy, const Tensor& x,
                         const Tensor& w, const Tensor& mean, const Tensor& rstd, bool rms) {
  int64_t rows = rows_of(x), n = x.size(-1);
  dispatch_floating(x.dtype(), rms ? "rms_norm_backward" : "layer_norm_backward", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    const S* px = x.data<S>();
    const S* pdy = dy.data<S>();
    const S* pw = w.defined() ? w.data<S>() : nullptr;
    const T* pmean = rms ? nullptr : mean.data<T>();
    const T* prstd = rstd.data<T>();
    S* pdx = g.dx.data<S>();
    bool want_w = g.dweight.defined(), want_b = g.dbias.defined();
    // Weight and bias gradients: partial sums over fixed blocks of rows (at
    // most 64 blocks), added in block order at the end: no atomics, and the
    // same bits whatever the number of threads.
    int64_t parts = std::clamp<int64_t>((rows + 63) / 64, 1, 64);
    int64_t per_part = (rows + parts - 1) / parts;
    // Both are accumulated even when not wanted, and a missing weight is a row
    // of ones: the row loop then has no branch and vectorises.
    std::vector<double> part_w(static_cast<size_t>(parts * n), 0.0);
    std::vector<double> part_b(static_cast<size_t>(parts * n), 0.0);
    std::vector<S> ones(pw ? 0 : static_cast<size_t>(n), store<S>(T(1)));
    if (!pw) pw = ones.data();
    parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        double* aw = part_w.data() + t * n;
        double* ab = part_b.data() + t * n;
        for (int64_t r = t * per_part; r < std::min(rows, (t + 1) * per_part); ++r) {
          const S* xr = px + r * n;
          const S* gr = pdy + r * n;
          S* dxr = pdx + r * n;
          T m = pmean ? pmean[r] : T(0), rs = prstd[r];
          auto xhat = [=](int64_t j) { return (load(xr[j]) - m) * rs; };
          auto ghat = [=](int64_t j) { return load(gr[j]) * load(pw[j]); };
          // sum(g_hat) and sum(g_hat * x_hat) of the row; the weight and bias
          // gradients' partial sums in the same pass.
          SumPair<double> sums = lane_sum2<double>(n, [&](int64_t j) {
            double xh = static_cast<double>(xhat(j)), gh = static_cast<double>(ghat(j));
            aw[j] += static_cast<double>(load(gr[j])) * xh;
            ab[j] += static_cast<double>(load(gr[j]));
            return SumPair<double>{gh, gh * xh};
          });
          T mg = rms ? T(0) : static_cast<T>(sums.a / static_cast<double>(n));
          T mgx = static_cast<T>(sums.b / static_cast<double>(n));
          for (int64_t j = 0; j < n; ++j) dxr[j] = store<S>(rs * (ghat(j) - mg - xhat(j) * mgx));
        }
      }
    });
    auto finish = [&](const std::vector<double>& part, const Tensor& out) {
      S* po = out.data<S>();
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t t = 0; t < parts; ++t) s += part[static_cast<size_t>(t * n + j)];
        po[j] = store<S>(static_cast<T>(s));
      }
    };
    if (want_w) finish(part_w, g.dweight);
    if (want_b) finish(part_b, g.dbias);
  });
}

namespace {
template <class F>
void with_indices(const Tensor& indices, F&& f) {
  if (indices.dtype() == DType::I64) return f(indices.data<int64_t>());
  if (indices.dtype() == DType::I32) return f(indices.data<int32_t>());
  TS_CHECK(false, "embedding: indices must be i32 or i64, got {}", dtype_name(indices.dtype()));
}

// Every index a row of a table of `rows`: checked before any row is read or written.
template <class I>
void check_rows(const char* op, const I* idx, int64_t count, int64_t rows) {
  for (int64_t i = 0; i < count; ++i)
    TS_CHECK(idx[i] >= 0 && idx[i] < rows, "{}: index {} at position {} is out of range for a table of {} rows", op,
             static_cast<int64_t>(idx[i]), i, rows);
}

// Every target a class (or ignore_index): checked before any row is read or written.
void check_targets(const char* op, const int64_t* pt, int64_t rows, int64_t c, int64_t ignore_index) {
  for (int64_t r = 0; r < rows; ++r)
    TS_CHECK(pt[r] == ignore_index || (pt[r] >= 0 && pt[r] < c),
             "{}: target {} at position {} is out of range for {} classes", op, pt[r], r, c);
}
}  // namespace

void embedding(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  int64_t v = weight.size(0), d = weight.size(1), count = indices.numel();
  size_t row_bytes = static_cast<size_t>(d) * dtype_size(weight.dtype());
  with_indices(indices, [&](auto* idx) {
    check_rows("embedding", idx, count, v);
    if (row_bytes == 0) return;  // a shard with no columns (more ranks than the table's width)
    const char* pw = static_cast<const char*>(weight.data_ptr());
    char* po = static_cast<char*>(out.data_ptr());
    parallel_for(0, count, row_grain(d), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        std::memcpy(po + i * row_bytes, pw + static_cast<int64_t>(idx[i]) * row_bytes, row_bytes);
    });
  });
}

// gw in f32 or f64; grad in gw's dtype, or bf16/f16 widened as it is read
// into an f32 gw (the bits of adding a widened copy, without the copy).
void embedding_backward(const Tensor& gw, const Tensor& grad, const Tensor& indices) {
  int64_t d = gw.size(1), count = indices.numel();
  dispatch_floating(grad.dtype(), "embedding_backward", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    TS_CHECK(gw.dtype() == DTypeOf<T>::value, "embedding_backward: a {} gradient sums into {}, got {}",
             dtype_name(grad.dtype()), dtype_name(DTypeOf<T>::value), dtype_name(gw.dtype()));
    T* pw = gw.data<T>();
    const S* pg = grad.data<S>();
    with_indices(indices, [&](auto* idx) {
      check_rows("embedding_backward", idx, count, gw.size(0));
      // Threads own disjoint column ranges, so rows hit twice never race.
      parallel_for(0, d, 64, [&](int64_t c0, int64_t c1) {
        for (int64_t i = 0; i < count; ++i) {
          T* dst = pw + static_cast<int64_t>(idx[i]) * d;
          const S* src = pg + i * d;
          for (int64_t c = c0; c < c1; ++c) dst[c] += load(src[c]);
        }
      });
    });
  });
}

void cross_entropy(const Tensor& losses, const Tensor& lse, const Tensor& logits,
                   const Tensor& target, int64_t ignore_index) {
  int64_t rows = logits.size(0), c = logits.size(1);
  const int64_t* pt = target.data<int64_t>();
  check_targets("cross_entropy", pt, rows, c, ignore_index);
  dispatch_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    const S* px = logits.data<S>();
    T* pl = losses.data<T>();
    T* plse = lse.data<T>();
    parallel_for(0, rows, row_grain(c), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const S* xr = px + r * c;
        T m = lane_max(c, -std::numeric_limits<T>::infinity(), [xr](int64_t j) { return load(xr[j]); });
        T sum = lane_sum<T>(c, [xr, m](int64_t j) { return fast_exp(load(xr[j]) - m); });
        T l = m + std::log(sum);
        plse[r] = l;
        pl[r] = pt[r] == ignore_index ? T(0) : l - load(xr[pt[r]]);
      }
    });
  });
}

void cross_entropy_backward(const Tensor& glogits, const Tensor& scale_tensor, const Tensor& logits,
                            const Tensor& target, const Tensor& lse, int64_t ignore_index) {
  int64_t rows = logits.size(0), c = logits.size(1);
  const double scale = scale_tensor.data<double>()[0];
  const int64_t* pt = target.data<int64_t>();
  check_targets("cross_entropy_backward", pt, rows, c, ignore_index);
  dispatch_floating(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;
    const S* px = logits.data<S>();
    const T* plse = lse.data<T>();
    S* pg = glogits.data<S>();
    T s = static_cast<T>(scale);
    parallel_for(0, rows, row_grain(c), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        S* g = pg + r * c;
        if (pt[r] == ignore_index) {
          std::fill(g, g + c, store<S>(T(0)));
          continue;
        }
        const S* xr = px + r * c;
        T l = plse[r];
        const int64_t target = pt[r];
        for (int64_t j = 0; j < c; ++j) g[j] = store<S>(s * fast_exp(load(xr[j]) - l));
        g[target] = store<S>(s * fast_exp(load(xr[target]) - l) - s);  // rounded once
      }
    });
  });
}

void rope(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  int64_t t = x.size(-2), d = x.size(-1), half = d / 2;
  int64_t planes = t == 0 || d == 0 ? 0 : x.numel() / (t * d);
  dispatch_floating(x.dtype(), "rope", [&](auto tag) {
    using S = decltype(tag);
    using T = Compute<S>;  // cos and sin are in T
    const S* px = x.data<S>();
    const T* pc = cos.data<T>();
    const T* ps = sin.data<T>();
    S* po = out.data<S>();
    T sign = inverse ? T(-1) : T(1);
    parallel_for(0, planes * t, row_grain(d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int64_t pos = r % t;
        const S* xr = px + r * d;
        S* o = po + r * d;
        const T* cr = pc + pos * half;
        const T* sr = ps + pos * half;
        for (int64_t j = 0; j < half; ++j) {
          T x1 = load(xr[j]), x2 = load(xr[j + half]), cs = cr[j], sn = sign * sr[j];
          o[j] = store<S>(x1 * cs - x2 * sn);
          o[j + half] = store<S>(x2 * cs + x1 * sn);
        }
      }
    });
  });
}

}  // namespace tessera::cpu::TS_CPU_ISA
