// Where a tensor's bytes live. `meta` tensors have shapes and no bytes: a model
// can be built on meta, sharded, and only then materialised. `async_cpu` is the
// asynchronous CPU test device (runtime/stream.h): host memory that the
// contract treats as device memory, so code that reads bytes without a copy
// to the host, or orders streams wrongly, fails on it as it would on a GPU.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

enum class DeviceType : uint8_t { CPU, CUDA, Meta, AsyncCPU };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device meta() { return {DeviceType::Meta, 0}; }
  static Device cuda(int index) { return {DeviceType::CUDA, index}; }
  static Device async_cpu() { return {DeviceType::AsyncCPU, 0}; }
  static Device parse(const std::string& name);  // "cpu", "meta", "cuda", "cuda:1", "async_cpu"

  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_meta() const { return type == DeviceType::Meta; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  // The host may read and write the bytes directly (data<T>()); elsewhere a
  // copy to Device::cpu() comes first.
  bool is_host_visible() const { return type == DeviceType::CPU; }
  std::string str() const;  // "cpu", "meta", "cuda:0"

  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type != DeviceType::CUDA || a.index == b.index);
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

}  // namespace tessera
