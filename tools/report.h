// What tessera-train shows and keeps (rank 0 only): a progress bar on a
// terminal, log lines, a JSONL metrics file and a loss-curve PNG.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace tessera::tools {

std::string format_duration(double seconds);  // "3m07s", "42s"

// A one-line progress bar redrawn in place when stdout is a terminal;
// log lines printed through it clear the bar first. Off the terminal (a pipe,
// CI) only the log lines appear.
class Progress {
 public:
  // mode: "on" draws the bar, "off" never, "auto" when stdout is a terminal
  // and `launched` is false (mpirun gives ranks a pseudo-terminal even when
  // its own output goes to a file, so under a launcher auto means off).
  Progress(int64_t total_steps, const std::string& mode, bool launched);
  void update(int64_t step, double loss, double tokens_per_s, double eta_s);
  void line(const std::string& text);  // a permanent line
  void finish();

 private:
  int64_t total_;
  bool tty_;
  bool drawn_ = false;
};

// Appends one JSON object per line; flushed after each, so a crashed run keeps its metrics.
class JsonlWriter {
 public:
  // "" = off; append continues a resumed run's file, otherwise it starts empty.
  JsonlWriter(const std::string& path, bool append);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const std::string& json_object);

 private:
  std::FILE* f_ = nullptr;
};

// The loss curve: one training loss per step and validation points (step, loss).
struct LossCurve {
  std::vector<std::pair<int64_t, double>> train, val;
  double baseline = 0;  // drawn as a horizontal line when > 0
};
// Writes a PNG with gnuplot. Returns "" on success or why it could not (no gnuplot).
std::string plot_loss_png(const LossCurve& curve, const std::string& png_path,
                          const std::string& title);

}  // namespace tessera::tools
