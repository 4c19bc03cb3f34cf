// Checkpoint save and load throughput against the disk's ceiling, in one run:
//   save       fsdp::save_checkpoint of the FSDP GPT model + AdamW moments
//              (each rank writes its own file in parallel, fsync, atomic commit)
//   plain-write  every rank write()s the same number of bytes to a file of its
//              own with one sequential loop and fsyncs (the same I/O, nothing else)
//   load       fsdp::load_checkpoint into a fresh sharded model (page cache
//              dropped for the files first: posix_fadvise DONTNEED)
//   plain-read   every rank read()s its plain file back the same way
// MB/s in total (all bytes / slowest rank) and per rank (mean), and the ratio
// of Tessera to the plain I/O. Median over repeats.
//   mpirun -np 4 -x OMP_NUM_THREADS=1 build/benchmarks/bench_checkpoint [dir] [repeats] [n_layer]
//   [n_embd]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "dtensor/dtensor.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "nn/models.h"
#include "nn/optim.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double reduce(double v, dist::ReduceOp op) {
  Tensor t = full({1}, v, DType::F64);
  dist::world()->all_reduce(t, {op})->wait();
  return t.item();
}

void drop_cache(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void plain_write(const fs::path& p, const std::vector<char>& buf) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TS_CHECK(fd >= 0, "cannot create {}", p.string());
  for (size_t at = 0; at < buf.size();) {
    ssize_t w = ::write(fd, buf.data() + at, buf.size() - at);
    TS_CHECK(w > 0, "write failed");
    at += static_cast<size_t>(w);
  }
  ::fsync(fd);
  ::close(fd);
}

void plain_read(const fs::path& p, std::vector<char>& buf) {
  int fd = ::open(p.c_str(), O_RDONLY);
  TS_CHECK(fd >= 0, "cannot open {}", p.string());
  for (size_t at = 0; at < buf.size();) {
    ssize_t r = ::read(fd, buf.data() + at, buf.size() - at);
    TS_CHECK(r > 0, "read failed");
    at += static_cast<size_t>(r);
  }
  ::close(fd);
}

struct Timing {
  double total_mbs, per_rank_mbs;
};

// Throughput of an operation that moves `bytes` on this rank and took `secs`.
Timing throughput(double bytes, double secs) {
  double total = reduce(bytes, dist::ReduceOp::Sum), slowest = reduce(secs, dist::ReduceOp::Max);
  double per_rank = reduce(bytes / secs, dist::ReduceOp::Sum) / dist::world_size();
  return {total / slowest / 1e6, per_rank / 1e6};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  dist::init(argc, argv);
  std::string base = argc > 1 ? argv[1] : "/tmp/tessera-bench-ckpt";
  int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  nn::TransformerConfig c;
  c.vocab_size = 256;
  c.block_size = 128;
  c.n_layer = argc > 3 ? std::atoll(argv[3]) : 4;
  c.n_head = 4;
  c.n_embd = argc > 4 ? std::atoll(argv[4]) : 256;
  int rank = dist::rank(), w = dist::world_size();
  auto mesh = init_device_mesh("cpu", {w}, {"dp"});

  auto build = [&](uint64_t seed) {
    auto model = nn::GPT::on_meta(c);
    for (auto& b : model->blocks) fsdp::fully_shard(*b, {.mesh = mesh});
    fsdp::fully_shard(*model, {.mesh = mesh});
    model->to_empty(Device::cpu());
    model->init_weights(seed);
    return model;
  };
  auto model = build(1);
  optim::AdamW opt(model->parameters(), {.lr = 1e-3});
  opt.init_state();
  auto fresh = build(2);
  optim::AdamW fresh_opt(fresh->parameters(), {.lr = 1e-3});

  fs::path folder = fs::path(base) / fmt::format("w{}", w);
  if (rank == 0) fs::remove_all(folder);
  dist::world()->barrier()->wait();
  std::vector<double> save_s, load_s, write_s, read_s;
  double bytes = 0;
  for (int r = 0; r < repeats; ++r) {
    dist::world()->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    std::string dir = fsdp::save_checkpoint(folder.string(), r, *model, &opt, "{}", 0);
    save_s.push_back(seconds_since(t0));
    fs::path mine = fs::path(dir) / fmt::format("rank-{:05d}.bin", rank);
    bytes = static_cast<double>(fs::file_size(mine));
    drop_cache(mine);
    if (rank == 0) drop_cache(fs::path(dir) / "metadata.json");
    dist::world()->barrier()->wait();
    t0 = std::chrono::steady_clock::now();
    fsdp::load_checkpoint(dir, *fresh, &fresh_opt);
    dist::world()->barrier()->wait();
    load_s.push_back(seconds_since(t0));

    std::vector<char> buf(static_cast<size_t>(bytes), 'x');
    fs::path plain = folder / fmt::format("plain-{:05d}.bin", rank);
    dist::world()->barrier()->wait();
    t0 = std::chrono::steady_clock::now();
    plain_write(plain, buf);
    write_s.push_back(seconds_since(t0));
    drop_cache(plain);
    dist::world()->barrier()->wait();
    t0 = std::chrono::steady_clock::now();
    plain_read(plain, buf);
    read_s.push_back(seconds_since(t0));
    fs::remove(plain);
  }
  Timing save = throughput(bytes, median(save_s)), write = throughput(bytes, median(write_s));
  Timing load = throughput(bytes, median(load_s)), read = throughput(bytes, median(read_s));
  double total_mb = reduce(bytes, dist::ReduceOp::Sum) / 1e6;
  if (rank == 0) {
    std::printf(
        "checkpoint of GPT (%lld layers, d=%lld) + AdamW: %.1f MB on %d rank(s), median of %d\n",
        static_cast<long long>(c.n_layer), static_cast<long long>(c.n_embd), total_mb, w, repeats);
    std::printf("%-12s %12s %14s %10s\n", "", "total MB/s", "per rank MB/s", "vs plain");
    std::printf("%-12s %12.0f %14.0f %10.2f\n", "save", save.total_mbs, save.per_rank_mbs,
                save.total_mbs / write.total_mbs);
    std::printf("%-12s %12.0f %14.0f %10s\n", "plain-write", write.total_mbs, write.per_rank_mbs,
                "1.00");
    std::printf("%-12s %12.0f %14.0f %10.2f\n", "load", load.total_mbs, load.per_rank_mbs,
                load.total_mbs / read.total_mbs);
    std::printf("%-12s %12.0f %14.0f %10s\n", "plain-read", read.total_mbs, read.per_rank_mbs,
                "1.00");
    fs::remove_all(folder);
  }
  return 0;
}
