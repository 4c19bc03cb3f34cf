// A machine as a hardware description file gives it (hardware/*.toml): what
// tessera-plan --hardware plans memory and step time for.
#pragma once

#include <map>
#include <string>

namespace tessera::tools {

struct Hardware {
  std::string name, source;
  int devices_per_node = 1;
  double memory_bytes = 0;
  std::map<std::string, double> peak_flops;  // by compute dtype: "bfloat16", "float32"
  double memory_bandwidth = 0;               // bytes/s
  double gemm_efficiency = 1, memory_efficiency = 1;
  double kernel_overhead_s = 0;  // per kernel (launch)
  double intra_node_bandwidth = 0, intra_node_latency_s = 0;  // per device, one direction
  double inter_node_bandwidth = 0, inter_node_latency_s = 0;
};

// Reads and checks a description: a regular file of at most 1 MiB; every
// field of its type and range (rates and sizes positive and finite, devices a
// whole number from 1 to 65536, efficiencies in (0, 1], latencies and
// overheads finite and >= 0); an unknown section or key is refused, naming
// it and the file, as tessera-train's config keys are.
Hardware load_hardware(const std::string& path);
// The same from the file's text (`path` names it in errors).
Hardware parse_hardware(const std::string& text, const std::string& path);

}  // namespace tessera::tools
