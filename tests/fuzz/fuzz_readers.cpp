// Fuzz-style test of the two readers of untrusted files: thousands of mutated
// safetensors headers/files and checkpoint metadata/data files, fed to the
// readers built with AddressSanitizer and UBSan (tests/meson.build compiles
// nn/safetensors.cpp and fsdp/checkpoint_format.cpp into this program with them).
// Every input must be either accepted or rejected with a tessera::Error; any
// other exception, a crash or a sanitizer report fails the test.
//
//   fuzz_readers [iterations per reader (default 4000)] [seed]
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "fsdp/checkpoint.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "runtime/distributed.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

std::mt19937_64 rng;

size_t pick(size_t n) {
  return n == 0 ? 0 : static_cast<size_t>(rng() % n);
}

const std::vector<std::string> kValues = {"-1",
                                          "0",
                                          "1",
                                          "7",
                                          "4294967295",
                                          "4294967296",
                                          "9223372036854775807",
                                          "18446744073709551615",
                                          "18446744073709551616",
                                          "281474976710656",
                                          "1e308",
                                          "-0.5",
                                          "null",
                                          "true",
                                          "[]",
                                          "{}",
                                          "\"\"",
                                          "\"F32\"",
                                          "\"BF16\"",
                                          "\"x/../y\"",
                                          "[0, 0]",
                                          "[1, 2, 3]",
                                          "[18446744073709551615, 4]",
                                          "\"rank-00000.bin\""};

// One random edit of a text: bit flips, deletions, duplicated spans, a token
// replaced by an interesting value, or truncation.
void mutate_once(std::string& s) {
  switch (pick(6)) {
    case 0:  // flip a few bits
      for (int i = 0, n = 1 + static_cast<int>(pick(4)); i < n && !s.empty(); ++i)
        s[pick(s.size())] ^= static_cast<char>(1u << pick(8));
      break;
    case 1:  // delete a span
      if (!s.empty()) {
        size_t at = pick(s.size());
        s.erase(at, 1 + pick(std::min<size_t>(16, s.size() - at)));
      }
      break;
    case 2: {  // duplicate a span elsewhere
      if (s.empty()) break;
      size_t from = pick(s.size()), len = 1 + pick(std::min<size_t>(32, s.size() - from));
      s.insert(pick(s.size() + 1), s.substr(from, len));
      break;
    }
    case 3:
    case 4: {  // replace a number or quoted token by an interesting value
      std::vector<std::pair<size_t, size_t>> tokens;
      for (size_t i = 0; i < s.size();) {
        if (std::isdigit(static_cast<unsigned char>(s[i]))) {
          size_t j = i;
          while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
          tokens.emplace_back(i, j - i);
          i = j;
        } else if (s[i] == '"') {
          size_t j = s.find('"', i + 1);
          if (j == std::string::npos) break;
          tokens.emplace_back(i, j - i + 1);
          i = j + 1;
        } else {
          ++i;
        }
      }
      if (tokens.empty()) break;
      auto [at, len] = tokens[pick(tokens.size())];
      s.replace(at, len, kValues[pick(kValues.size())]);
      break;
    }
    case 5:  // truncate
      s.resize(pick(s.size() + 1));
      break;
  }
}

std::string mutate(std::string s) {
  for (size_t i = 0, n = 1 + pick(3); i < n; ++i) mutate_once(s);
  return s;
}

struct Counts {
  int64_t accepted = 0, rejected = 0, failures = 0;
};

// Runs fn; a tessera::Error is a rejection, anything else a failure.
template <class Fn>
void feed(Counts& c, const std::string& what, const std::string& input, Fn&& fn) {
  try {
    fn();
    ++c.accepted;
  } catch (const Error&) {
    ++c.rejected;
  } catch (const std::exception& e) {
    ++c.failures;
    std::fprintf(stderr, "FAIL (%s): %s threw %s\n  input: %.300s\n", what.c_str(),
                 typeid(e).name(), e.what(), input.c_str());
  }
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A valid safetensors file: several dtypes, a scalar, an empty tensor, metadata.
std::string valid_safetensors(const fs::path& dir) {
  nn::StateDict sd;
  sd.emplace_back("a.weight", randn({3, 5}, 1));
  sd.emplace_back("b.bias", ops::to(randn({7}, 2), DType::BF16));
  sd.emplace_back("c", full({}, 3.0, DType::I64));
  sd.emplace_back("d.empty", zeros({0, 2}));
  sd.emplace_back("e", ops::to(randn({2, 2, 2}, 3), DType::F16));
  fs::path p = dir / "seed.safetensors";
  nn::save_safetensors(p, sd, {{"format", "pt"}});
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  dist::init(argc, argv);  // world size 1: no launcher, no MPI
  int64_t iterations = argc > 1 ? std::atoll(argv[1]) : 4000;
  rng.seed(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 20261129);
  char tmpl[] = "/tmp/tessera-fuzz-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 2;
  fs::path dir = tmpl;

  // --- safetensors: headers through parse_header, whole files through the reader.
  std::string seed_file = valid_safetensors(dir);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | static_cast<unsigned char>(seed_file[static_cast<size_t>(i)]);
  std::string seed_header = seed_file.substr(8, header_len),
              seed_data = seed_file.substr(8 + header_len);
  Counts st;
  for (int64_t i = 0; i < iterations; ++i) {
    std::string header = mutate(seed_header);
    uint64_t data_size = pick(4) == 0 ? pick(1 << 20) : seed_data.size();
    feed(st, "parse_header", header,
         [&] { nn::SafetensorsFile::parse_header(header, data_size, "fuzz"); });
    if (i % 8 == 0) {  // the whole file: length prefix, header, data (any of them mutated)
      std::string bytes = seed_file;
      if (pick(2)) bytes = bytes.substr(0, 8) + header + seed_data;
      if (pick(3) == 0) bytes = mutate(bytes);
      fs::path p = dir / "fuzz.safetensors";
      write_file(p, bytes);
      feed(st, "SafetensorsFile", bytes.substr(0, 300), [&] {
        nn::SafetensorsFile f(p, 1 << 20);
        for (const auto& e : f.entries()) f.read(e.name, DType::F64);
      });
    }
  }

  // --- checkpoint metadata through parse_metadata; whole checkpoints through read_chunk.
  fs::path ckpt = dir / "ckpt";
  fs::create_directories(ckpt);
  // A valid checkpoint written the ordinary way (world size 1, no launcher).
  nn::Linear model(5, 3, true);
  std::string step_dir = fsdp::save_checkpoint(ckpt.string(), 1, model, nullptr);
  std::ifstream md_in(fs::path(step_dir) / "metadata.json");
  std::string seed_md((std::istreambuf_iterator<char>(md_in)), std::istreambuf_iterator<char>());
  std::ifstream data_in(fs::path(step_dir) / "rank-00000.bin", std::ios::binary);
  std::string seed_bin((std::istreambuf_iterator<char>(data_in)), std::istreambuf_iterator<char>());
  Counts ck;
  for (int64_t i = 0; i < iterations; ++i) {
    std::string text = mutate(seed_md);
    feed(ck, "parse_metadata", text, [&] { fsdp::parse_metadata(text, "fuzz/metadata.json"); });
    if (i % 8 == 0) {
      write_file(fs::path(step_dir) / "metadata.json", pick(2) ? text : seed_md);
      write_file(fs::path(step_dir) / "rank-00000.bin", pick(2) ? mutate(seed_bin) : seed_bin);
      feed(ck, "read_chunk", text, [&] {
        auto md = fsdp::read_metadata(step_dir);
        for (const auto& t : md.tensors)
          for (const auto& c : t.chunks) fsdp::read_chunk(step_dir, t, c);
      });
    }
  }
  fs::remove_all(dir);
  std::printf("safetensors: %lld inputs, %lld accepted, %lld rejected, %lld failures\n",
              static_cast<long long>(st.accepted + st.rejected + st.failures),
              static_cast<long long>(st.accepted), static_cast<long long>(st.rejected),
              static_cast<long long>(st.failures));
  std::printf("checkpoint:  %lld inputs, %lld accepted, %lld rejected, %lld failures\n",
              static_cast<long long>(ck.accepted + ck.rejected + ck.failures),
              static_cast<long long>(ck.accepted), static_cast<long long>(ck.rejected),
              static_cast<long long>(ck.failures));
  // Both readers must have rejected most inputs and accepted some (the fuzzer reaches past the
  // first check).
  bool exercised = st.rejected > iterations / 4 && ck.rejected > iterations / 4 &&
                   st.accepted > 0 && ck.accepted > 0;
  if (!exercised) std::printf("the mutations did not exercise both outcomes of both readers\n");
  return st.failures == 0 && ck.failures == 0 && exercised ? 0 : 1;
}
