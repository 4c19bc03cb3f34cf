// tessera-plan: one rank's memory, communication and compute for a
// tessera-train configuration at a given number of ranks, predicted without
// running it (tools/plan.h).
//
//   tessera-plan --ranks 1,2,4 --preset tiny --model.n_layer 12
//
// Takes tessera-train's arguments (--config, --preset, --section.key value)
// plus --ranks (a comma-separated list of world sizes, default 1) and --rank
// (the rank to plan, default 0).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/check.h"
#include "tools/config.h"
#include "tools/plan.h"

using namespace tessera;

namespace {

int64_t parse_count(const std::string& flag, const std::string& text, int64_t lowest) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TS_CHECK(used == text.size() && !text.empty() && v >= lowest && v <= (1 << 20),
           "{}: expected an integer from {} to {}, got '{}'", flag, lowest, 1 << 20, text);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<int> worlds = {1};
    int rank = 0;
    std::vector<char*> rest = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      bool ranks = a == "--ranks" || a.rfind("--ranks=", 0) == 0;
      bool one = a == "--rank" || a.rfind("--rank=", 0) == 0;
      if (!ranks && !one) {
        rest.push_back(argv[i]);
        continue;
      }
      std::string value;
      if (a.find('=') != std::string::npos) {
        value = a.substr(a.find('=') + 1);
      } else {
        TS_CHECK(i + 1 < argc, "{} needs a value", a);
        value = argv[++i];
      }
      if (ranks) {
        worlds.clear();
        for (const auto& item : tools::split_list(value))
          worlds.push_back(static_cast<int>(parse_count("--ranks", item, 1)));
        TS_CHECK(!worlds.empty(), "--ranks: expected a list of world sizes such as 1,2,4, got '{}'", value);
      } else {
        rank = static_cast<int>(parse_count("--rank", value, 0));
      }
    }
    tools::TrainConfig cfg;
    int rest_argc = static_cast<int>(rest.size());
    if (!tools::parse_args(cfg, rest_argc, rest.data(), "tessera-plan")) {
      std::printf(
          "\ntessera-plan's own options:\n"
          "  --ranks N[,N...]   world sizes to plan (default 1)\n"
          "  --rank R           the rank to plan (default 0)\n");
      return 0;
    }
    for (int world : worlds) {
      tools::Plan plan = tools::plan_run(cfg, world, rank);
      std::fputs(tools::format_plan(plan, cfg).c_str(), stdout);
      std::fputs("\n", stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-plan: error: %s\n", e.what());
    return 2;
  }
}
