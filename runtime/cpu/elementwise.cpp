// Elementwise CPU kernels: copy/convert, fill, unary math and its derivatives,
// binary ops with broadcasting, where, and the in-place updates optimizers use.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "runtime/cpu/isa_copy.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/cpu/loops.h"
#include "runtime/cpu/sums.h"
#include "runtime/cpu/kernels_cpu.h"
#include "runtime/kernels.h"

namespace tessera::cpu::TS_CPU_ISA {

using ops::BinaryOp;
using ops::UnaryOp;

namespace {

// A copy into contiguous dst from a src whose unit-stride dim is not the
// last (a transpose made contiguous): element by element it reads a new
// cache line for every element (6.3 ms for 1024 x 1024 f32 on the AVX-512
// Xeon), so it goes in square tiles whose src lines stay in L1 (1.1 ms).
// Each element is copied as it is, so the bits are those of any order.
// Returns false (nothing copied) where the layout is not one of these.
template <class E>
bool copy_transposed(const Tensor& dst, const Tensor& src) {
  constexpr int64_t kTile = 32;
  const int64_t nd = dst.dim();
  if (nd < 2 || !dst.is_contiguous() || src.stride(nd - 1) == 1 || dst.size(nd - 1) < kTile) return false;
  int64_t across = -1;  // the dim src runs along
  for (int64_t d = 0; d < nd - 1; ++d)
    if (src.stride(d) == 1 && dst.size(d) >= kTile) across = d;
  if (across < 0) return false;
  const int64_t cols = dst.size(nd - 1), rows = dst.size(across);
  const int64_t dst_row = dst.stride(across), src_col = src.stride(nd - 1);
  // The other dims, walked by a flat index.
  std::vector<int64_t> sizes, dst_st, src_st;
  for (int64_t d = 0; d < nd - 1; ++d)
    if (d != across) sizes.push_back(dst.size(d)), dst_st.push_back(dst.stride(d)), src_st.push_back(src.stride(d));
  const int64_t outer = shape_numel(sizes), row_tiles = (rows + kTile - 1) / kTile;
  E* out = static_cast<E*>(dst.data_ptr());
  const E* in = static_cast<const E*>(src.data_ptr());
  parallel_for(0, outer * row_tiles, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      int64_t o = w / row_tiles, od = 0, os = 0;
      for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
        od += o % sizes[d] * dst_st[d];
        os += o % sizes[d] * src_st[d];
        o /= sizes[d];
      }
      const int64_t r0 = w % row_tiles * kTile, r1 = std::min(rows, r0 + kTile);
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t c1 = std::min(cols, c0 + kTile);
        for (int64_t r = r0; r < r1; ++r) {
          E* to = out + od + r * dst_row;
          const E* from = in + os + r;
          for (int64_t c = c0; c < c1; ++c) to[c] = from[c * src_col];
        }
      }
    }
  });
  return true;
}

}  // namespace

void copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype() && dst.numel() > 0) {
    const size_t es = dtype_size(dst.dtype());
    if (es == 2 && copy_transposed<uint16_t>(dst, src)) return;
    if (es == 4 && copy_transposed<uint32_t>(dst, src)) return;
    if (es == 8 && copy_transposed<uint64_t>(dst, src)) return;
  }
  StridedLoop<2> loop(dst.shape(), {&dst, &src});
  if (dst.dtype() == src.dtype()) {
    int64_t es = static_cast<int64_t>(dtype_size(dst.dtype()));
    loop.run([es](std::array<char*, 2> p, const std::array<int64_t, 2>& s, int64_t n) {
      if (s[0] == es && s[1] == es) {
        std::memcpy(p[0], p[1], static_cast<size_t>(n * es));
        return;
      }
      for (int64_t i = 0; i < n; ++i) std::memcpy(p[0] + i * s[0], p[1] + i * s[1], es);
    });
    return;
  }
  dispatch_all(dst.dtype(), [&](auto d) {
    using D = decltype(d);
    dispatch_all(src.dtype(), [&](auto sv) {
      using S = decltype(sv);
      auto convert = [](S v) {
        D out;
        if constexpr (std::is_same_v<S, float> && std::is_same_v<D, BFloat16>)
          out = float_to_bf16(v);
        else if constexpr (std::is_same_v<S, BFloat16> && std::is_same_v<D, float>)
          out = bf16_to_float(v);
        else
          out = from_double<D>(to_double(v));
        return out;
      };
      loop.run([convert](std::array<char*, 2> p, const std::array<int64_t, 2>& s, int64_t n) {
        if (s[0] == sizeof(D) && s[1] == sizeof(S)) {  // contiguous: a loop that vectorises
          D* out = reinterpret_cast<D*>(p[0]);
          const S* in = reinterpret_cast<const S*>(p[1]);
          for (int64_t i = 0; i < n; ++i) out[i] = convert(in[i]);
          return;
        }
        for (int64_t i = 0; i < n; ++i) {
          S v;
          std::memcpy(&v, p[1] + i * s[1], sizeof(S));
          D out = convert(v);
          std::memcpy(p[0] + i * s[0], &out, sizeof(D));
        }
      });
    });
  });
}

void fill(const Tensor& dst, double value) {
  dispatch_all(dst.dtype(), [&](auto d) {
    using D = decltype(d);
    D v = from_double<D>(value);
    StridedLoop<1> loop(dst.shape(), {&dst});
    loop.run([v](std::array<char*, 1> p, const std::array<int64_t, 1>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) std::memcpy(p[0] + i * s[0], &v, sizeof(D));
    });
  });
}

using math::apply_unary;
using math::apply_unary_backward;

// For storage T of f32 and bf16 (computed in f32 vectors), elements in
// runs of kRun: a loop of fixed length inside, which GCC vectorises as four
// vectors (AVX2) side by side. An exact GELU is a chain of about 40
// dependent operations per vector (erfc's division, polynomial and exp); one
// vector at a time, the core ran out of room for the next ones' chains. Each
// element is the same expression as before, so the bits are too. GELU over
// 1M f32 on the AVX2 EPYC, three alternating runs of bench_kernels: 2.27-2.56
// -> 1.54-2.11 ms forward, 3.53-3.73 -> 2.60-3.41 ms backward (bf16 alike;
// benchmarks/README.md). f16's conversions do not vectorise, and in runs its
// GELU backward ran 9x slower; f64's transcendental functions are library
// calls: both one element at a time.
constexpr int64_t kRun = 32;
template <class T>
constexpr bool kInRuns = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;

// The switch is hoisted out of the loop by instantiating one loop per op.
// T is the storage type: bf16/f16 are read into f32 registers, computed on
// there, and rounded once when stored (runtime/cpu/dispatch.h).
template <class T, UnaryOp Op>
void unary_loop(T* out, const T* x, int64_t n) {
  int64_t i = 0;
  if constexpr (kInRuns<T>) {
    for (; i + kRun <= n; i += kRun) {
#pragma GCC unroll 32
      for (int64_t j = i; j < i + kRun; ++j) out[j] = store<T>(apply_unary(Op, load(x[j])));
    }
  }
  for (; i < n; ++i) out[i] = store<T>(apply_unary(Op, load(x[i])));
}

template <class T>
void unary_contiguous(UnaryOp op, T* out, const T* x, int64_t n) {
  switch (op) {
#define TS_UNARY_CASE(name) \
  case UnaryOp::name: return unary_loop<T, UnaryOp::name>(out, x, n);
    TS_UNARY_CASE(Neg) TS_UNARY_CASE(Exp) TS_UNARY_CASE(Log) TS_UNARY_CASE(Sqrt)
    TS_UNARY_CASE(Rsqrt) TS_UNARY_CASE(Abs) TS_UNARY_CASE(Tanh) TS_UNARY_CASE(Sigmoid)
    TS_UNARY_CASE(Relu) TS_UNARY_CASE(Gelu) TS_UNARY_CASE(GeluTanh) TS_UNARY_CASE(Silu)
    TS_UNARY_CASE(Sin) TS_UNARY_CASE(Cos) TS_UNARY_CASE(Square) TS_UNARY_CASE(Reciprocal)
    TS_UNARY_CASE(Sign)
#undef TS_UNARY_CASE
  }
}

void unary(UnaryOp op, const Tensor& out, const Tensor& x) {
  dispatch_floating(out.dtype(), ops::unary_name(op), [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<2> loop(out.shape(), {&out, &x});
    loop.run([op](std::array<char*, 2> p, const std::array<int64_t, 2>& s, int64_t n) {
      if (s[0] == sizeof(T) && s[1] == sizeof(T))
        return unary_contiguous<T>(op, reinterpret_cast<T*>(p[0]), reinterpret_cast<T*>(p[1]), n);
      for (int64_t i = 0; i < n; ++i)
        *reinterpret_cast<T*>(p[0] + i * s[0]) =
            store<T>(apply_unary(op, load(*reinterpret_cast<T*>(p[1] + i * s[1]))));
    });
  });
}

template <class T, UnaryOp Op>
void unary_backward_loop(T* gx, const T* gy, const T* x, const T* y, int64_t n) {
  int64_t i = 0;
  if constexpr (kInRuns<T>) {
    for (; i + kRun <= n; i += kRun) {
#pragma GCC unroll 32
      for (int64_t j = i; j < i + kRun; ++j)
        gx[j] = store<T>(apply_unary_backward(Op, load(gy[j]), load(x[j]), load(y[j])));
    }
  }
  for (; i < n; ++i) gx[i] = store<T>(apply_unary_backward(Op, load(gy[i]), load(x[i]), load(y[i])));
}

template <class T>
void unary_backward_contiguous(UnaryOp op, T* gx, const T* gy, const T* x, const T* y, int64_t n) {
  switch (op) {
#define TS_UNARY_BWD_CASE(name) \
  case UnaryOp::name: return unary_backward_loop<T, UnaryOp::name>(gx, gy, x, y, n);
    TS_UNARY_BWD_CASE(Neg) TS_UNARY_BWD_CASE(Exp) TS_UNARY_BWD_CASE(Log) TS_UNARY_BWD_CASE(Sqrt)
    TS_UNARY_BWD_CASE(Rsqrt) TS_UNARY_BWD_CASE(Abs) TS_UNARY_BWD_CASE(Tanh)
    TS_UNARY_BWD_CASE(Sigmoid) TS_UNARY_BWD_CASE(Relu) TS_UNARY_BWD_CASE(Gelu)
    TS_UNARY_BWD_CASE(GeluTanh) TS_UNARY_BWD_CASE(Silu) TS_UNARY_BWD_CASE(Sin)
    TS_UNARY_BWD_CASE(Cos) TS_UNARY_BWD_CASE(Square) TS_UNARY_BWD_CASE(Reciprocal)
    TS_UNARY_BWD_CASE(Sign)
#undef TS_UNARY_BWD_CASE
  }
}

void unary_backward(UnaryOp op, const Tensor& gx, const Tensor& gy, const Tensor& x,
                    const Tensor& y) {
  // y may be undefined for ops that only need x; point it at x then.
  const Tensor& yy = y.defined() ? y : x;
  dispatch_floating(gx.dtype(), ops::unary_name(op), [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<4> loop(gx.shape(), {&gx, &gy, &x, &yy});
    loop.run([op](std::array<char*, 4> p, const std::array<int64_t, 4>& s, int64_t n) {
      constexpr int64_t e = sizeof(T);
      if (s[0] == e && s[1] == e && s[2] == e && s[3] == e)
        return unary_backward_contiguous<T>(op, reinterpret_cast<T*>(p[0]), reinterpret_cast<T*>(p[1]),
                                            reinterpret_cast<T*>(p[2]), reinterpret_cast<T*>(p[3]), n);
      for (int64_t i = 0; i < n; ++i)
        *reinterpret_cast<T*>(p[0] + i * s[0]) = store<T>(
            apply_unary_backward(op, load(*reinterpret_cast<T*>(p[1] + i * s[1])),
                                 load(*reinterpret_cast<T*>(p[2] + i * s[2])),
                                 load(*reinterpret_cast<T*>(p[3] + i * s[3]))));
    });
  });
}

using math::apply_binary;
using math::apply_compare;
using math::is_compare;

template <class T, BinaryOp Op>
void binary_inner(char* o, const char* a, const char* b, int64_t so, int64_t sa, int64_t sb,
                  int64_t n) {
  constexpr int64_t e = sizeof(T);
  T* out = reinterpret_cast<T*>(o);
  const T* x = reinterpret_cast<const T*>(a);
  const T* y = reinterpret_cast<const T*>(b);
  if (so == e && sa == e && sb == e) {
    for (int64_t i = 0; i < n; ++i) out[i] = store<T>(apply_binary(Op, load(x[i]), load(y[i])));
  } else if (so == e && sa == e && sb == 0) {
    Compute<T> yv = load(*y);
    for (int64_t i = 0; i < n; ++i) out[i] = store<T>(apply_binary(Op, load(x[i]), yv));
  } else if (so == e && sa == 0 && sb == e) {
    Compute<T> xv = load(*x);
    for (int64_t i = 0; i < n; ++i) out[i] = store<T>(apply_binary(Op, xv, load(y[i])));
  } else {
    for (int64_t i = 0; i < n; ++i)
      *reinterpret_cast<T*>(o + i * so) =
          store<T>(apply_binary(Op, load(*reinterpret_cast<const T*>(a + i * sa)),
                                load(*reinterpret_cast<const T*>(b + i * sb))));
  }
}

template <class T>
void binary_typed(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  StridedLoop<3> loop(out.shape(), {&out, &a, &b});
  if (is_compare(op)) {
    loop.run([op](std::array<char*, 3> p, const std::array<int64_t, 3>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i)
        *reinterpret_cast<bool*>(p[0] + i * s[0]) =
            apply_compare(op, load(*reinterpret_cast<T*>(p[1] + i * s[1])),
                          load(*reinterpret_cast<T*>(p[2] + i * s[2])));
    });
    return;
  }
  loop.run([op](std::array<char*, 3> p, const std::array<int64_t, 3>& s, int64_t n) {
    switch (op) {
#define TS_BINARY_CASE(name) \
  case BinaryOp::name: return binary_inner<T, BinaryOp::name>(p[0], p[1], p[2], s[0], s[1], s[2], n);
      TS_BINARY_CASE(Add) TS_BINARY_CASE(Sub) TS_BINARY_CASE(Mul) TS_BINARY_CASE(Div)
      TS_BINARY_CASE(Pow) TS_BINARY_CASE(Maximum) TS_BINARY_CASE(Minimum)
#undef TS_BINARY_CASE
      default: break;
    }
  });
}

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  switch (a.dtype()) {
    case DType::F32: return binary_typed<float>(op, out, a, b);
    case DType::F64: return binary_typed<double>(op, out, a, b);
    case DType::BF16: return binary_typed<BFloat16>(op, out, a, b);
    case DType::F16: return binary_typed<Half>(op, out, a, b);
    case DType::I32: return binary_typed<int32_t>(op, out, a, b);
    case DType::I64: return binary_typed<int64_t>(op, out, a, b);
    case DType::Bool: return binary_typed<bool>(op, out, a, b);
    default: TS_CHECK(false, "{}: unsupported dtype {}", ops::binary_name(op), dtype_name(a.dtype()));
  }
}

void binary_scalar(BinaryOp op, const Tensor& out, const Tensor& a, double s, bool scalar_first) {
  if (a.dtype() == DType::BF16 || a.dtype() == DType::F16) {
    // The scalar stays in f32, the compute type, instead of being rounded to
    // the tensor's dtype first (0.99 in bf16 would be 0.990234375).
    float v = static_cast<float>(s);
    dispatch_floating(a.dtype(), ops::binary_name(op), [&](auto tag) {
      using T = decltype(tag);
      StridedLoop<2> loop(out.shape(), {&out, &a});
      loop.run([op, v, scalar_first](std::array<char*, 2> p, const std::array<int64_t, 2>& st,
                                     int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          float x = load(*reinterpret_cast<T*>(p[1] + i * st[1]));
          *reinterpret_cast<T*>(p[0] + i * st[0]) =
              store<T>(scalar_first ? apply_binary(op, v, x) : apply_binary(op, x, v));
        }
      });
    });
    return;
  }
  Tensor sc = empty({}, a.dtype());
  fill(sc, s);
  Tensor expanded = ops::expand(sc, a.shape());
  if (scalar_first) binary(op, out, expanded, a);
  else binary(op, out, a, expanded);
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  dispatch_all(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<4> loop(out.shape(), {&out, &cond, &a, &b});
    loop.run([](std::array<char*, 4> p, const std::array<int64_t, 4>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        bool c = *reinterpret_cast<bool*>(p[1] + i * s[1]);
        std::memcpy(p[0] + i * s[0], c ? p[2] + i * s[2] : p[3] + i * s[3], sizeof(T));
      }
    });
  });
}

template <class T, PointwiseOp Op>
void pointwise_inner(std::array<char*, 3> p, const std::array<int64_t, 3>& s, int64_t n,
                     Compute<T> c) {
  constexpr int64_t e = sizeof(T);
  auto step = [c](T& x, T a, T b) {
    Compute<T> v = load(x);
    math::apply_pointwise<Op>(v, load(a), load(b), c);
    x = store<T>(v);
  };
  if (s[0] == e && s[1] == e && (s[2] == e || Op == PointwiseOp::AddScaled || Op == PointwiseOp::Lerp)) {
    T* x = reinterpret_cast<T*>(p[0]);
    const T* a = reinterpret_cast<const T*>(p[1]);
    const T* b = reinterpret_cast<const T*>(p[2]);
    constexpr bool uses_b = Op == PointwiseOp::Addcmul || Op == PointwiseOp::Addcdiv;
    for (int64_t i = 0; i < n; ++i) step(x[i], a[i], uses_b ? b[i] : a[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    step(*reinterpret_cast<T*>(p[0] + i * s[0]), *reinterpret_cast<T*>(p[1] + i * s[1]),
         *reinterpret_cast<T*>(p[2] + i * s[2]));
}

void pointwise(PointwiseOp op, const Tensor& x, const Tensor& a, const Tensor& b, double s) {
  const Tensor& bb = b.defined() ? b : a;
  dispatch_floating(x.dtype(), "in-place update", [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<3> loop(x.shape(), {&x, &a, &bb});
    Compute<T> c = static_cast<Compute<T>>(s);
    loop.run([op, c](std::array<char*, 3> p, const std::array<int64_t, 3>& st, int64_t n) {
      switch (op) {
        case PointwiseOp::AddScaled: return pointwise_inner<T, PointwiseOp::AddScaled>(p, st, n, c);
        case PointwiseOp::Addcmul: return pointwise_inner<T, PointwiseOp::Addcmul>(p, st, n, c);
        case PointwiseOp::Addcdiv: return pointwise_inner<T, PointwiseOp::Addcdiv>(p, st, n, c);
        case PointwiseOp::Lerp: return pointwise_inner<T, PointwiseOp::Lerp>(p, st, n, c);
      }
    });
  });
}

void clamp(const Tensor& x, double lo, double hi) {
  dispatch_floating(x.dtype(), "clamp_", [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<1> loop(x.shape(), {&x});
    Compute<T> l = static_cast<Compute<T>>(lo), h = static_cast<Compute<T>>(hi);
    loop.run([l, h](std::array<char*, 1> p, const std::array<int64_t, 1>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        T& x = *reinterpret_cast<T*>(p[0] + i * s[0]);
        Compute<T> v = load(x);
        x = store<T>(v < l ? l : (v > h ? h : v));
      }
    });
  });
}

// AdamW over many tensors: their elements cut into chunks of kAdamWChunk, so
// that many small tensors (biases, norms) share the threads with large ones;
// one pass over each element (math::adamw_update). bf16/f16 compute in f32
// registers and round once per store, as the CUDA kernel does.
constexpr int64_t kAdamWChunk = 16384;

template <class T, class C>
void adamw_chunk(const Tensor& pt, const Tensor& gt, const Tensor& mt, const Tensor& vt, int64_t begin,
                 int64_t end, const math::AdamWConstants<C>& k) {
  T* __restrict p = pt.data<T>();
  const T* __restrict g = gt.data<T>();
  T* __restrict m = mt.data<T>();
  T* __restrict v = vt.data<T>();
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (std::is_same_v<T, C>) {
      math::adamw_update(p[i], g[i], m[i], v[i], k);
    } else {
      C pc = load(p[i]), mc = load(m[i]), vc = load(v[i]);
      math::adamw_update(pc, load(g[i]), mc, vc, k);
      p[i] = store<T>(pc);
      m[i] = store<T>(mc);
      v[i] = store<T>(vc);
    }
  }
}

// Elements [begin, end) of xs[tensor].
struct Chunk {
  size_t tensor;
  int64_t begin, end;
};

// Every element of every x (each floating) in chunks of kAdamWChunk: one
// parallel loop over many tensors, as over one flat buffer (which ran
// 0.93-1.16x as fast as GPT's 52 tensors: benchmarks/bench_kernels).
std::vector<Chunk> chunks_of(const std::vector<Tensor>& xs, const char* op) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < xs.size(); ++t) {
    TS_CHECK(is_floating(xs[t].dtype()), "{}: expected float tensors, got {}", op, dtype_name(xs[t].dtype()));
    for (int64_t b = 0; b < xs[t].numel(); b += kAdamWChunk)
      chunks.push_back({t, b, std::min(b + kAdamWChunk, xs[t].numel())});
  }
  return chunks;
}

void adamw(const std::vector<Tensor>& ps, const std::vector<Tensor>& gs, const std::vector<Tensor>& ms,
           const std::vector<Tensor>& vs, const ops::AdamWStep& step) {
  const std::vector<Chunk> chunks = chunks_of(ps, "adamw_");
  const auto k32 = math::adamw_constants<float>(step);
  const auto k64 = math::adamw_constants<double>(step);
  parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const Chunk& ch = chunks[static_cast<size_t>(c)];
      size_t t = ch.tensor;
      switch (ps[t].dtype()) {
        case DType::F64: adamw_chunk<double>(ps[t], gs[t], ms[t], vs[t], ch.begin, ch.end, k64); break;
        case DType::F32: adamw_chunk<float>(ps[t], gs[t], ms[t], vs[t], ch.begin, ch.end, k32); break;
        case DType::BF16: adamw_chunk<BFloat16>(ps[t], gs[t], ms[t], vs[t], ch.begin, ch.end, k32); break;
        case DType::F16: adamw_chunk<Half>(ps[t], gs[t], ms[t], vs[t], ch.begin, ch.end, k32); break;
        default: break;  // checked above
      }
    }
  });
}

// Many tensors times one scalar read from `coef` (f64) where the kernel runs:
// f32 (f64 for f64) products rounded once, binary_scalar's bits for Mul.
void scale(const std::vector<Tensor>& xs, const Tensor& coef) {
  const double c = *coef.data<double>();
  const std::vector<Chunk> chunks = chunks_of(xs, "scale_");
  parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t i = c0; i < c1; ++i) {
      const Chunk& ch = chunks[static_cast<size_t>(i)];
      const Tensor& x = xs[ch.tensor];
      dispatch_floating(x.dtype(), "scale_", [&](auto tag) {
        using T = decltype(tag);
        using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
        const C v = static_cast<C>(c);
        T* __restrict p = x.data<T>();
        for (int64_t e = ch.begin; e < ch.end; ++e) p[e] = store<T>(static_cast<C>(load(p[e])) * v);
      });
    }
  });
}

// Llama's gate, fused: one pass and one output instead of silu's and mul's.
// silu(gate) is rounded to the storage dtype before the product, as the two
// ops round it, so the result is theirs bit for bit in every dtype; so is the
// backward (dgate through silu's derivative of grad * up, dup = grad * silu).
void swiglu(const Tensor& out, const Tensor& gate, const Tensor& up) {
  dispatch_floating(out.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<3> loop(out.shape(), {&out, &gate, &up});
    loop.run([](std::array<char*, 3> p, const std::array<int64_t, 3>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const T a = store<T>(apply_unary(UnaryOp::Silu, load(*reinterpret_cast<const T*>(p[1] + i * s[1]))));
        *reinterpret_cast<T*>(p[0] + i * s[0]) = store<T>(load(a) * load(*reinterpret_cast<const T*>(p[2] + i * s[2])));
      }
    });
  });
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& grad, const Tensor& gate,
                     const Tensor& up) {
  dispatch_floating(grad.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    StridedLoop<5> loop(grad.shape(), {&dgate, &dup, &grad, &gate, &up});
    loop.run([](std::array<char*, 5> p, const std::array<int64_t, 5>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        auto at = [&](int k) -> T& { return *reinterpret_cast<T*>(p[k] + i * s[k]); };
        const auto g = load(at(2)), x = load(at(3));
        const T a = store<T>(apply_unary(UnaryOp::Silu, x));
        const T da = store<T>(g * load(at(4)));  // d loss / d silu(gate)
        at(0) = store<T>(apply_unary_backward(UnaryOp::Silu, load(da), x, load(a)));
        at(1) = store<T>(g * load(a));
      }
    });
  });
}

// GPT-2's MLP: c_fc's bias added in GELU's pass instead of one of its own.
// x + bias is rounded to the storage dtype before GELU, as add rounds it, so
// the result is add's then gelu's bit for bit in every dtype. The backward
// takes GELU's derivative at the same rounded sum and sums the rounded
// gradients over the rows as it stores them, in reduce's order and output
// dtype (column_sums, f64 accumulators): the bias gradient without a pass.
template <class T, UnaryOp Op>
void bias_gelu_typed(T* out, const T* x, const T* bias, int64_t rows, int64_t n) {
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      T* y = out + r * n;
      for (int64_t j = 0; j < n; ++j) y[j] = store<T>(apply_unary(Op, load(store<T>(load(xr[j]) + load(bias[j])))));
    }
  });
}

template <class T, UnaryOp Op, class O>
void bias_gelu_backward_typed(T* gx, O* gbias, const T* grad, const T* x, const T* bias, int64_t rows, int64_t n) {
  auto block = [&](double* acc, int64_t, int64_t k0, int64_t k1, int64_t j0, int64_t len) {
    const T* b = bias + j0;
    for (int64_t k = k0; k < k1; ++k) {
      const T* g = grad + k * n + j0;
      const T* xr = x + k * n + j0;
      T* d = gx + k * n + j0;
      for (int64_t j = 0; j < len; ++j) {
        const auto z = load(store<T>(load(xr[j]) + load(b[j])));
        d[j] = store<T>(apply_unary_backward(Op, load(g[j]), z, z));
      }
      for (int64_t j = 0; j < len; ++j) acc[j] += static_cast<double>(load(d[j]));
    }
  };
  column_sums<double>(1, rows, n, true, 0.0, block, [&](int64_t, int64_t j0, int64_t len, const double* acc) {
    for (int64_t j = 0; j < len; ++j) gbias[j0 + j] = static_cast<O>(acc[j]);
  });
}

void bias_gelu(const Tensor& out, const Tensor& x, const Tensor& bias, bool tanh_approx) {
  const int64_t n = bias.numel(), rows = n > 0 ? x.numel() / n : 0;
  if (rows == 0) return;
  dispatch_floating(x.dtype(), "bias_gelu", [&](auto tag) {
    using T = decltype(tag);
    if (tanh_approx) bias_gelu_typed<T, UnaryOp::GeluTanh>(out.data<T>(), x.data<T>(), bias.data<T>(), rows, n);
    else bias_gelu_typed<T, UnaryOp::Gelu>(out.data<T>(), x.data<T>(), bias.data<T>(), rows, n);
  });
}

void bias_gelu_backward(const Tensor& gx, const Tensor& gbias, const Tensor& grad, const Tensor& x,
                        const Tensor& bias, bool tanh_approx) {
  const bool widened = x.dtype() == DType::BF16 || x.dtype() == DType::F16;
  TS_CHECK(gbias.dtype() == (widened ? DType::F32 : x.dtype()),
           "bias_gelu_backward: {} gradients sum into a bias gradient of {}, got {}", dtype_name(x.dtype()),
           dtype_name(widened ? DType::F32 : x.dtype()), dtype_name(gbias.dtype()));
  const int64_t n = bias.numel(), rows = n > 0 ? x.numel() / n : 0;
  dispatch_floating(x.dtype(), "bias_gelu_backward", [&](auto tag) {
    using T = decltype(tag);
    using O = std::conditional_t<std::is_same_v<T, double>, double, float>;
    T* d = gx.data<T>();
    O* db = gbias.data<O>();
    const T *g = grad.data<T>(), *xs = x.data<T>(), *b = bias.data<T>();
    if (tanh_approx) bias_gelu_backward_typed<T, UnaryOp::GeluTanh>(d, db, g, xs, b, rows, n);
    else bias_gelu_backward_typed<T, UnaryOp::Gelu>(d, db, g, xs, b, rows, n);
  });
}

// Copies with the host are copies (the CPU is the host), and the kernels
// compiled once (GEMM: blas.cpp, whose libraries choose their own
// instruction sets; the random fills: random.cpp) are this copy's too.
void copy_from_host(const Tensor& dst, const Tensor& src) { copy(dst, src); }
void copy_to_host(const Tensor& dst, const Tensor& src) { copy(dst, src); }
void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void* a,
          int64_t lda, const void* b, int64_t ldb, double beta, void* c, int64_t ldc) {
  cpu::gemm(dtype, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void uniform(const Tensor& x, double low, double high, const RandomSpec& spec) { cpu::uniform(x, low, high, spec); }
void normal(const Tensor& x, double mean, double std, const RandomSpec& spec) { cpu::normal(x, mean, std, spec); }

}  // namespace tessera::cpu::TS_CPU_ISA
