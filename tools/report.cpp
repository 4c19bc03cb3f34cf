#include "tools/report.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "runtime/check.h"

namespace tessera::tools {

std::string format_duration(double seconds) {
  int s = static_cast<int>(std::lround(std::max(0.0, seconds)));
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  return s >= 60 ? fmt::format("{}m{:02}s", s / 60, s % 60) : fmt::format("{}s", s);
}

Progress::Progress(int64_t total_steps, const std::string& mode, bool launched)
    : total_(std::max<int64_t>(1, total_steps)),
      tty_(mode == "on" || (mode == "auto" && !launched && ::isatty(STDOUT_FILENO))) {}

void Progress::update(int64_t step, double loss, double tokens_per_s, double eta_s) {
  if (!tty_) return;
  constexpr int kWidth = 30;
  int filled = static_cast<int>(kWidth * step / total_);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::printf("\r\033[K[%s] %lld/%lld | loss %.4f | %.0f tok/s | eta %s", bar.c_str(),
              static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s,
              format_duration(eta_s).c_str());
  std::fflush(stdout);
  drawn_ = true;
}

void Progress::line(const std::string& text) {
  if (drawn_) std::printf("\r\033[K");
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
  drawn_ = false;
}

void Progress::finish() {
  if (drawn_) std::printf("\r\033[K");
  std::fflush(stdout);
  drawn_ = false;
}

JsonlWriter::JsonlWriter(const std::string& path, bool append) {
  if (path.empty()) return;
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  f_ = std::fopen(path.c_str(), append ? "a" : "w");
  TS_CHECK(f_ != nullptr, "cannot open metrics file '{}'", path);
}

JsonlWriter::~JsonlWriter() {
  if (f_) std::fclose(f_);
}

void JsonlWriter::write(const std::string& json_object) {
  if (!f_) return;
  std::fprintf(f_, "%s\n", json_object.c_str());
  std::fflush(f_);
}

std::string plot_loss_png(const LossCurve& curve, const std::string& png_path,
                          const std::string& title) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return "gnuplot is not installed (Debian: gnuplot-nox); no loss curve";
  std::string data = png_path + ".dat";
  {
    std::ofstream out(data);
    for (const auto& [s, l] : curve.train) out << s << ' ' << l << '\n';
    out << "\n\n";
    for (const auto& [s, l] : curve.val) out << s << ' ' << l << '\n';
  }
  std::string script = fmt::format(
      "set terminal png size 960,540\n"
      "set output '{png}'\n"
      "set title '{title}'\n"
      "set xlabel 'step'\nset ylabel 'loss (nats/token)'\nset grid\nset key top right\n"
      "plot '{dat}' index 0 using 1:2 with lines lw 1 lc rgb '#4477aa' title 'train'{val}{base}\n",
      fmt::arg("png", png_path), fmt::arg("title", title), fmt::arg("dat", data),
      fmt::arg("val",
               curve.val.empty()
                   ? std::string()
                   : fmt::format(", '{}' index 1 using 1:2 with linespoints lw 2 pt 7 lc rgb "
                                 "'#cc6677' title 'validation'",
                                 data)),
      fmt::arg("base",
               curve.baseline > 0
                   ? fmt::format(", {} with lines dt 2 lc rgb '#888888' title 'unigram baseline'",
                                 curve.baseline)
                   : std::string()));
  std::FILE* gp = ::popen("gnuplot 2>&1", "w");
  if (gp == nullptr) return "could not start gnuplot";
  std::fputs(script.c_str(), gp);
  int rc = ::pclose(gp);
  std::filesystem::remove(data);
  if (rc != 0 || !std::filesystem::exists(png_path))
    return fmt::format("gnuplot failed (exit {})", rc);
  return "";
}

}  // namespace tessera::tools
