// Why no GPU can be used, in words (internal to runtime/cuda/; host C++ with
// no CUDA header, so the CPU tests check it). A driver older than the toolkit
// the build was made with is not "no device": it is a machine to fix, and
// tools/gpu-check.sh fails on it instead of skipping.
#pragma once

#include <fmt/format.h>

#include <string>

namespace tessera::cuda {

// What cudaGetDeviceCount said, sorted.
enum class CountResult { Ok, NoDriver, InsufficientDriver, NoDevice, Other };

// "13.0" from CUDA's 13000.
inline std::string cuda_version_str(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

// "" when `count` devices can be used; else the reason. driver and runtime
// are cudaDriverGetVersion's and cudaRuntimeGetVersion's (0: no driver);
// `error` names cudaGetDeviceCount's error for Other.
inline std::string unavailable_reason(CountResult result, int count, int driver, int runtime, const char* visible,
                                      const std::string& error = "") {
  const std::string devices = visible ? fmt::format(" (CUDA_VISIBLE_DEVICES='{}')", visible) : "";
  switch (result) {
    case CountResult::Ok:
      return count > 0 ? "" : "no CUDA device is visible" + devices;
    case CountResult::NoDriver:
      return "no NVIDIA driver is installed (libcuda.so was not found): no GPU can be used";
    case CountResult::InsufficientDriver:
      return fmt::format(
          "the NVIDIA driver supports CUDA {} but this build needs CUDA {} (cudaErrorInsufficientDriver): "
          "install a newer driver, or build with the toolkit that matches this one",
          driver > 0 ? cuda_version_str(driver) : "(unknown)", cuda_version_str(runtime));
    case CountResult::NoDevice:
      return "no CUDA device is visible" + devices;
    case CountResult::Other:
      break;
  }
  return fmt::format("CUDA cannot be used: cudaGetDeviceCount failed with {}", error);
}

// True when the reason is a broken installation (a GPU machine to fix), not a
// machine without GPUs: the cuda suite fails on it rather than skipping.
inline bool is_broken_install(CountResult result) {
  return result == CountResult::InsufficientDriver || result == CountResult::Other;
}

}  // namespace tessera::cuda
