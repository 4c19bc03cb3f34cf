#include "tools/hardware.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "runtime/check.h"

namespace tessera::tools {

namespace {

// Every key a description may hold, by section ("" for the top level).
const std::map<std::string, std::set<std::string>>& known_keys() {
  static const std::map<std::string, std::set<std::string>> keys = {
      {"", {"name", "source"}},
      {"node", {"devices"}},
      {"device",
       {"memory_gib", "memory_bandwidth_gbs", "peak_tflops_bf16", "peak_tflops_f32", "gemm_efficiency",
        "memory_efficiency", "kernel_overhead_us"}},
      {"intra_node", {"bandwidth_gbs", "latency_us"}},
      {"inter_node", {"bandwidth_gbs", "latency_us"}},
  };
  return keys;
}

}  // namespace

Hardware parse_hardware(const std::string& text, const std::string& path) {
  toml::table t;
  try {
    t = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    TS_CHECK(false, "hardware file '{}': {} (line {})", path, std::string(e.description()), e.source().begin.line);
  }
  // Unknown sections and keys are mistakes, not something to drop silently.
  const auto& known = known_keys();
  for (const auto& [key, value] : t) {
    const std::string k(key.str());
    if (value.is_table()) {
      auto section = known.find(k);
      TS_CHECK(section != known.end() && !k.empty(), "hardware file '{}': unknown section [{}] (expected node, device, "
               "intra_node, inter_node)", path, k);
      for (const auto& [inner, v] : *value.as_table())
        TS_CHECK(section->second.count(std::string(inner.str())) == 1, "hardware file '{}': unknown key [{}] {} "
                 "(expected one of: {})", path, k, inner.str(), fmt::join(section->second, ", "));
    } else {
      TS_CHECK(known.at("").count(k) == 1, "hardware file '{}': unknown key {} at the top level (expected name, "
               "source or a section)", path, k);
    }
  }
  // `[section] key` as a number in [lo, hi] (an integer, a float or absent where allowed).
  auto number = [&](const char* section, const char* key, double lo, double hi, bool required = true,
                    double fallback = 0) {
    const auto node = t[section][key];
    if (!node) {
      TS_CHECK(!required, "hardware file '{}': [{}] {} is missing (a number)", path, section, key);
      return fallback;
    }
    auto v = node.value<double>();
    TS_CHECK(v.has_value() && (node.is_floating_point() || node.is_integer()), "hardware file '{}': [{}] {} must be "
             "a number, got {}", path, section, key, node.type() == toml::node_type::string ? "a string" : "another type");
    TS_CHECK(std::isfinite(*v) && *v >= lo, "hardware file '{}': [{}] {} = {} must be a finite number >= {}", path,
             section, key, *v, lo);
    TS_CHECK(*v <= hi, "hardware file '{}': [{}] {} = {} must be at most {}", path, section, key, *v, hi);
    return *v;
  };
  auto positive = [&](const char* section, const char* key) {
    const double v = number(section, key, 0, 1e18);
    TS_CHECK(v > 0, "hardware file '{}': [{}] {} must be > 0, got {}", path, section, key, v);
    return v;
  };
  auto text_of = [&](const char* key, std::string fallback) {
    const auto node = t[key];
    if (!node) return fallback;
    TS_CHECK(node.is_string(), "hardware file '{}': {} must be a string", path, key);
    return node.value_or(fallback);
  };
  Hardware hw;
  hw.name = text_of("name", std::filesystem::path(path).stem().string());
  hw.source = text_of("source", "");
  const double devices = number("node", "devices", 1, 65536);
  TS_CHECK(devices == std::floor(devices), "hardware file '{}': [node] devices must be a whole number, got {}", path,
           devices);
  hw.devices_per_node = static_cast<int>(devices);
  hw.memory_bytes = positive("device", "memory_gib") * 1073741824.0;
  hw.memory_bandwidth = positive("device", "memory_bandwidth_gbs") * 1e9;
  hw.peak_flops["bfloat16"] = positive("device", "peak_tflops_bf16") * 1e12;
  hw.peak_flops["float16"] = hw.peak_flops["bfloat16"];
  hw.peak_flops["float32"] = positive("device", "peak_tflops_f32") * 1e12;
  hw.gemm_efficiency = number("device", "gemm_efficiency", 0, 1, false, 1);
  hw.memory_efficiency = number("device", "memory_efficiency", 0, 1, false, 1);
  TS_CHECK(hw.gemm_efficiency > 0 && hw.memory_efficiency > 0, "hardware file '{}': [device] gemm_efficiency and "
           "memory_efficiency must be > 0 (at most 1)", path);
  hw.kernel_overhead_s = number("device", "kernel_overhead_us", 0, 1e9, false, 0) * 1e-6;
  hw.intra_node_bandwidth = positive("intra_node", "bandwidth_gbs") * 1e9;
  hw.intra_node_latency_s = number("intra_node", "latency_us", 0, 1e9) * 1e-6;
  hw.inter_node_bandwidth = positive("inter_node", "bandwidth_gbs") * 1e9;
  hw.inter_node_latency_s = number("inter_node", "latency_us", 0, 1e9) * 1e-6;
  return hw;
}

Hardware load_hardware(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  TS_CHECK(!ec || ec == std::errc::no_such_file_or_directory, "hardware file '{}' cannot be read: {}", path,
           ec.message());
  TS_CHECK(exists, "hardware file '{}' does not exist", path);
  TS_CHECK(fs::is_regular_file(path, ec), "hardware file '{}' is not a regular file", path);
  const uintmax_t size = fs::file_size(path, ec);
  TS_CHECK(!ec && size <= (uintmax_t{1} << 20), "hardware file '{}' is {} bytes; a description is read up to 1 MiB",
           path, size);
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hardware(ss.str(), path);
}

}  // namespace tessera::tools
