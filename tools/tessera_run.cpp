// tessera-run: launches tessera-train under mpirun (or srun), and when a rank
// dies or a collective times out, starts the job again from its newest
// complete checkpoint, on the ranks still there, up to job.max_restarts
// times (tools/restart.h).
//
//   tessera-run --np 4 -- --preset tiny --checkpoint.enable true --job.max_restarts 3
//   tessera-run --hostfile hosts --launcher "mpirun --bind-to none" -- --config run.toml
//
// Its own options come first; everything else (after an optional --) is
// tessera-train's, read here too for the run's folder, its checkpoints and
// job.max_restarts. A restart adds --checkpoint.resume true; the hostfile is
// read again before each launch, so a node taken out of it (by hand, or by
// the --on-failure command) is left out of the next one. Each launch's end is
// logged on stderr and in <dump_folder>/restarts.jsonl.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/checkpoint.h"
#include "runtime/check.h"
#include "tools/config.h"
#include "tools/restart.h"

using namespace tessera;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct RunOptions {
  int np = 0;                       // 0: the hostfile's slots, else 1
  std::string hostfile;             // read again before each launch
  std::string launcher = "mpirun";  // a command and its options, split at spaces; "none": no launcher
  std::string program;              // tessera-train ("": the one beside tessera-run)
  std::string on_failure;           // a shell command run before each restart; non-zero stops
  double restart_delay_s = 1;
};

void usage() {
  std::printf(
      "usage: tessera-run [options] [--] [tessera-train options]\n\n"
      "Runs tessera-train under a launcher and restarts it from its newest complete checkpoint\n"
      "when a rank fails, up to job.max_restarts times (a tessera-train key; default 0).\n\n"
      "  --np N              ranks to launch (default: the hostfile's slots, else 1)\n"
      "  --hostfile FILE     mpirun's hostfile, read again before each launch: a node taken\n"
      "                      out of it is left out of the next (the checkpoint reshards)\n"
      "  --launcher CMD      the launcher and its options (default \"mpirun\"; \"srun ...\";\n"
      "                      \"none\": one process, no launcher)\n"
      "  --program PATH      the tessera-train to run (default: the one beside tessera-run)\n"
      "  --on-failure CMD    a shell command run before each restart (TESSERA_FAILED_STEP,\n"
      "                      TESSERA_FAILED_ERROR, TESSERA_RESTART_COUNT set); non-zero stops\n"
      "  --restart-delay S   seconds to wait before a restart (default 1)\n");
}

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The child launcher's pid, for the signal handler to pass a stop on to.
volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_stop_signal = 0;

// SIGTERM and SIGHUP (a scheduler's) are passed on to the launcher, which
// passes them to the ranks (a clean stop, with a checkpoint); so is a SIGINT
// sent to tessera-run alone. A Ctrl-C at the terminal reaches the launcher
// directly (the same process group) and is not sent twice. Either way the
// job is not restarted.
void on_stop_signal(int sig, siginfo_t* info, void*) {
  g_stop_signal = sig;
  const bool from_terminal = sig == SIGINT && info != nullptr && info->si_code == SI_KERNEL;
  if (g_child > 0 && !from_terminal) ::kill(g_child, sig);
}

void install_handlers() {
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
}

// Runs argv; its exit code (128 + the signal that ended it).
int run_child(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  TS_CHECK(pid >= 0, "tessera-run: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "tessera-run: cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  g_child = pid;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    TS_CHECK(errno == EINTR, "tessera-run: waitpid failed: {}", std::strerror(errno));
  g_child = 0;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The command line of one launch on `np` ranks.
std::vector<std::string> launch_command(const RunOptions& o, int np, const std::vector<std::string>& train_args,
                                        bool resume) {
  std::vector<std::string> cmd;
  const std::vector<std::string> launcher = words(o.launcher);
  const std::string name = launcher.empty() ? "none" : fs::path(launcher[0]).filename().string();
  if (name != "none") {
    cmd = launcher;
    if (name == "srun") {
      cmd.push_back(fmt::format("--ntasks={}", np));
    } else {  // mpirun, mpiexec, orterun, prterun
      cmd.insert(cmd.end(), {"-np", std::to_string(np), "-x", "TESSERA_RESTART_COUNT"});
      if (!o.hostfile.empty()) cmd.insert(cmd.end(), {"--hostfile", o.hostfile});
    }
  }
  cmd.push_back(o.program);
  cmd.insert(cmd.end(), train_args.begin(), train_args.end());
  if (resume) cmd.insert(cmd.end(), {"--checkpoint.resume", "true"});
  return cmd;
}

void append_record(const fs::path& file, const json& record) {
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  std::ofstream(file, std::ios::app) << record.dump() << "\n";
}

int parse_int(const std::string& flag, const std::string& text, int lowest) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TS_CHECK(used == text.size() && used > 0 && v >= lowest && v <= 1000000, "{}: expected a count >= {}, got '{}'",
           flag, lowest, text);
  return static_cast<int>(v);
}

int run(int argc, char** argv) {
  RunOptions o;
  std::vector<std::string> train_args;
  bool once = false;  // --dry-run, --print-config, --eval-only: one launch, nothing to restart
  int i = 1;
  auto value = [&](const char* flag) -> std::string {
    TS_CHECK(i + 1 < argc, "{} needs a value", flag);
    return argv[++i];
  };
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "--np") o.np = parse_int("--np", value("--np"), 1);
    else if (a == "--hostfile") o.hostfile = value("--hostfile");
    else if (a == "--launcher") o.launcher = value("--launcher");
    else if (a == "--program") o.program = value("--program");
    else if (a == "--on-failure") o.on_failure = value("--on-failure");
    else if (a == "--restart-delay") o.restart_delay_s = parse_int("--restart-delay", value("--restart-delay"), 0);
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else break;  // tessera-train's from here on
  }
  for (; i < argc; ++i) train_args.push_back(argv[i]);

  // The run's settings, read as tessera-train reads them.
  tools::TrainConfig cfg;
  std::vector<std::string> parsed_args = {"tessera-train"};
  for (const auto& a : train_args) {
    if (a == "--dry-run" || a == "--print-config" || a == "--eval-only") once = true;
    else parsed_args.push_back(a);
  }
  std::vector<char*> pargv;
  for (auto& a : parsed_args) pargv.push_back(a.data());
  if (!tools::parse_args(cfg, static_cast<int>(pargv.size()), pargv.data(), "tessera-train")) {
    std::printf("\n");
    usage();
    return 0;
  }
  tools::validate(cfg);
  const int max_restarts = once ? 0 : static_cast<int>(cfg.job.max_restarts);
  TS_CHECK(max_restarts == 0 || cfg.checkpoint.enable,
           "job.max_restarts {}: a restart continues from the newest checkpoint, and checkpoint.enable is "
           "false; pass --checkpoint.enable true (checkpoint.interval sets how many steps a failure can cost)",
           max_restarts);
  const bool no_launcher = words(o.launcher).empty() || words(o.launcher)[0] == "none";
  TS_CHECK(!no_launcher || (o.np <= 1 && o.hostfile.empty()),
           "--launcher none runs one process: {} needs a launcher (mpirun, srun)",
           o.hostfile.empty() ? fmt::format("--np {}", o.np)
                              : o.np > 1 ? fmt::format("--np {} with --hostfile {}", o.np, o.hostfile)
                                         : fmt::format("--hostfile {}", o.hostfile));
  TS_CHECK(o.hostfile.empty() || words(o.launcher)[0].find("srun") == std::string::npos,
           "--hostfile is mpirun's: under srun the allocation says where the ranks run");
  if (o.program.empty()) {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    o.program = (ec ? fs::path("tessera-train") : self.parent_path() / "tessera-train").string();
  }
  TS_CHECK(fs::exists(o.program), "tessera-run: {} not found (pass --program PATH)", o.program);

  const fs::path folder = cfg.job.dump_folder;
  const fs::path status = folder / "status.json", log = folder / "restarts.jsonl";
  const fs::path checkpoints =
      fs::path(cfg.checkpoint.folder).is_absolute() ? fs::path(cfg.checkpoint.folder) : folder / cfg.checkpoint.folder;

  install_handlers();
  std::optional<tools::LaunchOutcome> previous;
  for (int restarts = 0;; ++restarts) {
    const int np = !o.hostfile.empty() ? (o.np > 0 ? std::min(o.np, tools::hostfile_slots(o.hostfile))
                                                   : tools::hostfile_slots(o.hostfile))
                                       : std::max(o.np, 1);
    ::setenv("TESSERA_RESTART_COUNT", std::to_string(restarts).c_str(), 1);
    const auto cmd = launch_command(o, np, train_args, restarts > 0);
    std::fprintf(stderr, "tessera-run: launch %d on %d rank%s\n", restarts + 1, np, np == 1 ? "" : "s");
    const std::time_t started = std::time(nullptr);
    const int code = run_child(cmd);
    if (g_stop_signal != 0) {
      std::fprintf(stderr, "tessera-run: stopped by signal %d; not restarting (launcher exit %d)\n",
                   static_cast<int>(g_stop_signal), code);
      append_record(log, {{"launch", restarts + 1}, {"ranks", np}, {"exit_code", code}, {"next", "stop"},
                          {"why", fmt::format("tessera-run received signal {}", static_cast<int>(g_stop_signal))},
                          {"time", std::time(nullptr)}});
      return code == 0 ? 128 + g_stop_signal : code;
    }
    const tools::LaunchOutcome now = tools::read_outcome(status.string(), code, started);
    const tools::Decision d = tools::decide(now, previous, restarts, max_restarts);
    json record = {{"launch", restarts + 1}, {"ranks", np},          {"exit_code", code},
                   {"status", now.status},   {"step", now.step},     {"error", now.error},
                   {"why", d.why},           {"time", std::time(nullptr)}};
    if (d.next == tools::Next::done) {
      if (restarts > 0 || max_restarts > 0) {
        record["next"] = "done";
        append_record(log, record);
      }
      if (restarts > 0)
        std::fprintf(stderr, "tessera-run: completed after %d restart%s\n", restarts, restarts == 1 ? "" : "s");
      return code;
    }
    if (d.next == tools::Next::stop) {
      record["next"] = "stop";
      append_record(log, record);
      std::fprintf(stderr, "tessera-run: stopping: %s\n", d.why.c_str());
      return code == 0 ? 1 : code;
    }
    // A restart: from the newest complete checkpoint (step 0 if none yet).
    const auto saved = fsdp::complete_checkpoints(checkpoints.string());
    const int64_t from = saved.empty() ? 0 : saved.back().first;
    record["next"] = "restart";
    record["resumed_from_step"] = from;
    if (now.step >= 0) record["steps_lost"] = std::max<int64_t>(0, now.step - from);
    std::fprintf(stderr, "tessera-run: %s; restart %d of %d from step %lld%s\n", d.why.c_str(), restarts + 1,
                 max_restarts, static_cast<long long>(from),
                 now.step >= 0 ? fmt::format(" ({} steps lost)", std::max<int64_t>(0, now.step - from)).c_str() : "");
    if (!o.on_failure.empty()) {
      ::setenv("TESSERA_FAILED_STEP", std::to_string(now.step).c_str(), 1);
      ::setenv("TESSERA_FAILED_ERROR", now.error.c_str(), 1);
      ::setenv("TESSERA_RESTART_COUNT", std::to_string(restarts + 1).c_str(), 1);
      const int hook = run_child({"/bin/sh", "-c", o.on_failure});
      if (hook != 0) {
        record["next"] = "stop";
        record["why"] = fmt::format("{}; the --on-failure command exited {}", d.why, hook);
        append_record(log, record);
        std::fprintf(stderr, "tessera-run: stopping: the --on-failure command exited %d\n", hook);
        return code;
      }
    }
    append_record(log, record);
    previous = now;
    std::this_thread::sleep_for(std::chrono::duration<double>(o.restart_delay_s));
    if (g_stop_signal != 0) {
      std::fprintf(stderr, "tessera-run: stopped by signal %d before the restart\n", static_cast<int>(g_stop_signal));
      return 128 + g_stop_signal;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-run: error: %s\n", e.what());
    return 2;
  }
}
