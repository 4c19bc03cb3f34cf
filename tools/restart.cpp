#include "tools/restart.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "runtime/check.h"

namespace tessera::tools {

using json = nlohmann::json;

int hostfile_slots(const std::string& path) {
  std::error_code ec;
  TS_CHECK(!std::filesystem::is_directory(path, ec), "hostfile {}: a directory, not a hostfile", path);
  TS_CHECK(!std::filesystem::exists(path, ec) || std::filesystem::is_regular_file(path, ec),
           "hostfile {}: not a regular file (a pipe or a device has no end to read to)", path);
  std::ifstream in(path);
  TS_CHECK(in.good(), "hostfile {}: cannot be read", path);
  int64_t total = 0;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;  // blank or comment
    // A host name as DNS allows (RFC 1123: at most 253 characters; letters,
    // digits, '-' and '.'), an IPv4 or IPv6 address, or user@host. Open MPI's
    // mpirun overran a buffer on a 300-character name (stack smashing) and
    // crashed on longer ones.
    constexpr const char* kHostCharacters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._:@[]";
    const bool name_ok = host.size() <= 253 && host.find_first_not_of(kHostCharacters) == std::string::npos;
    TS_CHECK(name_ok,
             "hostfile {} line {}: '{}' is not a host name (at most 253 characters: letters, digits, '-', '.', an "
             "IPv4 or IPv6 address, or user@host)", path, number,
             host.size() > 80 ? host.substr(0, 80) + fmt::format("... ({} characters)", host.size()) : host);
    int64_t slots = 1;
    while (words >> word) {
      if (word.rfind("slots=", 0) != 0) continue;  // max_slots=, and other options mpirun reads
      const std::string n = word.substr(6);
      const bool digits = !n.empty() && n.size() <= 6 &&
                          n.find_first_not_of("0123456789") == std::string::npos;
      TS_CHECK(digits && std::stoll(n) > 0,
               "hostfile {} line {}: slots must be a count from 1 to 999999, got '{}' in '{}'", path,
               number, n, line);
      slots = std::stoll(n);
    }
    total += slots;
    TS_CHECK(total <= 1000000, "hostfile {}: more than 1000000 slots in all (line {})", path, number);
  }
  TS_CHECK(total > 0, "hostfile {}: no host in it (lines 'host slots=N'), so no rank to start", path);
  return static_cast<int>(total);
}

LaunchOutcome read_outcome(const std::string& status_path, int exit_code, std::time_t launched_at) {
  LaunchOutcome out;
  out.exit_code = exit_code;
  json status;
  {
    std::ifstream in(status_path);
    if (in.good()) status = json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  const bool fresh = status.is_object() && status.contains("time") && status["time"].is_number_integer() &&
                     status["time"].get<int64_t>() >= static_cast<int64_t>(launched_at);
  if (fresh) {
    if (status.contains("status") && status["status"].is_string()) out.status = status["status"];
    if (status.contains("exit_code") && status["exit_code"].is_number_integer())
      out.status_exit = status["exit_code"].get<int>();
    if (status.contains("step") && status["step"].is_number_integer() && status["step"].get<int64_t>() >= 0)
      out.step = status["step"];
    if (status.contains("error") && status["error"].is_string()) out.error = status["error"];
  }
  if (out.status == "completed" || (exit_code == 0 && out.error.empty())) return out;
  if (out.error.empty()) {
    // No rank said what failed: one died outright (a signal, the OOM killer),
    // or the launcher itself failed.
    if (exit_code > 128 && exit_code < 160)
      out.error = fmt::format("a rank was killed by signal {} (the launcher exited {})", exit_code - 128,
                              exit_code);
    else if (out.status.empty())
      out.error = fmt::format("the launcher exited {} before tessera-train wrote its status", exit_code);
    else
      out.error = fmt::format("the launcher exited {}; no rank said why (status '{}')", exit_code, out.status);
  }
  return out;
}

namespace {

// The error with each run of digits set to '#'.
std::string without_numbers(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) {
      out += s[i];
      continue;
    }
    out += '#';
    while (i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) ++i;
  }
  return out;
}

}  // namespace

bool same_failure(const LaunchOutcome& a, const LaunchOutcome& b) {
  return a.step == b.step && a.exit_code == b.exit_code && without_numbers(a.error) == without_numbers(b.error);
}

Decision decide(const LaunchOutcome& now, const std::optional<LaunchOutcome>& previous, int restarts_done,
                int max_restarts) {
  const std::string at = now.step < 0 ? "before its first step" : fmt::format("at step {}", now.step);
  if (now.status == "completed" || (now.exit_code == 0 && now.error.empty())) return {Next::done, "completed"};
  if (now.status_exit == 2 || (now.exit_code == 2 && now.status == "failed"))
    return {Next::stop, fmt::format("tessera-train refused the launch ({}): a restart would be refused too",
                                    now.error)};
  if (now.status == "interrupted")
    return {Next::stop, fmt::format("the run was interrupted {} (a signal asked it to stop): not restarted", at)};
  if (previous && same_failure(now, *previous))
    return {Next::stop, fmt::format("the same failure {} twice: {}; a restart would repeat it", at, now.error)};
  if (restarts_done >= max_restarts)
    return {Next::stop, fmt::format("failed {}: {}; {} restart{} allowed (job.max_restarts) and {} made",
                                    at, now.error, max_restarts, max_restarts == 1 ? "" : "s", restarts_done)};
  return {Next::restart, fmt::format("failed {}: {}", at, now.error)};
}

}  // namespace tessera::tools
