// Counter-based random numbers (Philox 4x32-10). Element i of a tensor draws
// from counter i under the key (seed, stream), so any slice of a tensor can be
// generated without the rest: a sharded parameter initialised on 4 ranks holds
// exactly the values of the full tensor initialised on one.
#pragma once

#include <array>
#include <cstdint>

#include "runtime/tensor.h"

namespace tessera {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Which random numbers a tensor receives. The element at row-major position
// (i0, ..., ik) of the tensor draws counter base + sum(ij * index_strides[j]);
// empty index_strides means the tensor's own contiguous strides (base + i).
struct RandomSpec {
  uint64_t seed = 0;
  uint64_t stream = 0;
  int64_t base = 0;
  Shape index_strides;
};

// A seed plus an offset that advances by the counters drawn (for dropout).
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  void manual_seed(uint64_t seed) {
    seed_ = seed;
    offset_ = 0;
  }
  uint64_t seed() const { return seed_; }
  int64_t offset() const { return offset_; }
  void set_offset(int64_t offset) { offset_ = offset; }
  // The spec for the next n draws; advances the offset.
  RandomSpec next(int64_t n);

 private:
  uint64_t seed_;
  int64_t offset_ = 0;
};

Generator& default_generator();  // per thread
void manual_seed(uint64_t seed);

// Stable 64-bit hash of a string (FNV-1a): parameter names become RNG streams.
uint64_t hash_name(const std::string& name);

namespace ops {
void uniform_(const Tensor& x, double low, double high, const RandomSpec& spec);
void normal_(const Tensor& x, double mean, double std, const RandomSpec& spec);
// Multiplier for inverted dropout, 0 with probability p, else 1/(1-p), with
// the shape, dtype and device of `like` and laid out as it is: a subclass
// tensor's piece draws the counters of its global positions, so every layout
// drops what one process drops.
Tensor dropout_mask(const Tensor& like, double p, const RandomSpec& spec);
}  // namespace ops

// ---- factories -----------------------------------------------------------------
Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
            Device device = Device::cpu());
Tensor zeros_like(const Tensor& x);
Tensor empty_like(const Tensor& x);
Tensor arange(int64_t start, int64_t end, int64_t step = 1, DType dtype = DType::I64,
              Device device = Device::cpu());
Tensor scalar_tensor(double value, DType dtype = DType::F32, Device device = Device::cpu());
// Copies `values` into a new tensor of `shape` (numel must match) and dtype of T
// (through the host: on another device, one copy queued on its current stream).
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = Device::cpu());
Tensor rand(const Shape& shape, uint64_t seed, DType dtype = DType::F32, Device device = Device::cpu());
Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::F32, Device device = Device::cpu());
Tensor uniform(const Shape& shape, double low, double high, uint64_t seed,
               DType dtype = DType::F32, Device device = Device::cpu());
Tensor normal(const Shape& shape, double mean, double std, uint64_t seed,
              DType dtype = DType::F32, Device device = Device::cpu());
// Random integers in [low, high) (i64), for token data in tests.
Tensor randint(const Shape& shape, int64_t low, int64_t high, uint64_t seed,
               Device device = Device::cpu());

}  // namespace tessera
