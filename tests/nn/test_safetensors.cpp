// The safetensors reader and writer: round trips of every dtype at odd shapes,
// a file from an independent writer (Python, standard library only), and
// malformed files rejected with the file and tensor named.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "nn/safetensors.h"
#include "tests/helpers.h"

using namespace tessera;
using namespace tessera::testing;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/tessera-st-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() { fs::remove_all(path); }
};

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A file from a header text and a data section.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

}  // namespace

TEST_CASE("safetensors round trip: every dtype, odd shapes, conversion on read", "[safetensors]") {
  TempDir dir;
  nn::StateDict sd;
  sd.emplace_back("w.f32", randn({5, 3, 7}, 1));
  sd.emplace_back("w.f64", randn({11}, 2, DType::F64));
  sd.emplace_back("w.bf16", ops::to(randn({3, 13}, 3), DType::BF16));
  sd.emplace_back("w.f16", ops::to(randn({9}, 4), DType::F16));
  sd.emplace_back("i.i32", ops::to(randint({6}, -100, 100, 5), DType::I32));
  sd.emplace_back("i.i64", randint({2, 3}, -100000, 100000, 6));
  sd.emplace_back("b.bool", gt(randn({10}, 7), zeros({10})));
  sd.emplace_back("e.empty", zeros({0, 5}));
  sd.emplace_back("s.scalar", full({}, 2.5));
  sd.emplace_back("v.view",
                  ops::transpose(randn({4, 6}, 8), 0, 1));  // non-contiguous: written contiguous
  fs::path p = dir.path / "all.safetensors";
  nn::save_safetensors(p, sd, {{"step", "17"}});

  nn::SafetensorsFile f(p);
  CHECK(f.metadata().at("step") == "17");
  REQUIRE(f.entries().size() == sd.size());
  for (auto& [k, v] : sd) {
    INFO(k);
    Tensor got = f.read(k);
    CHECK(got.dtype() == v.dtype());
    CHECK(equal(got, v));
  }
  // Conversion on read, and rows of dim 0 only.
  CHECK(equal(f.read("w.bf16", DType::F32), ops::to(sd[2].second, DType::F32)));
  CHECK(equal(f.read("w.f64", DType::F16), ops::to(sd[1].second, DType::F16)));
  // Only floating point converts: integers (or booleans) where weights are
  // expected, or the reverse, are refused naming the tensor and both dtypes.
  CHECK_THROWS_WITH(f.read("i.i32", DType::F32),
                    Contains("tensor 'i.i32' is I32 in the file but F32 is expected"));
  CHECK_THROWS_WITH(f.read("b.bool", DType::BF16), Contains("tensor 'b.bool' is BOOL in the file"));
  CHECK_THROWS_WITH(f.read_rows("w.f32", 0, 1, DType::I64),
                    Contains("tensor 'w.f32' is F32 in the file but I64 is expected"));
  CHECK(equal(f.read("i.i32", DType::I32), sd[4].second));
  CHECK(equal(f.read_rows("w.f32", 2, 2), ops::narrow(sd[0].second, 0, 2, 2)));
  CHECK(f.read_rows("w.f32", 5, 0).numel() == 0);
  CHECK_THROWS_WITH(f.read_rows("w.f32", 4, 2), Contains("rows [4, 6) of tensor 'w.f32'"));
  CHECK_THROWS_WITH(f.read("nope"), Contains("no tensor named 'nope'"));
  // The data section is 8-byte aligned.
  std::ifstream in(p, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  CHECK((8 + header_len) % 8 == 0);
}

TEST_CASE("safetensors written by an independent Python writer", "[safetensors][interop]") {
  const char* python = std::getenv("TESSERA_PYTHON");
  const char* script = std::getenv("TESSERA_SAFETENSORS_WRITER");
  if (python == nullptr || script == nullptr) {
    WARN("TESSERA_PYTHON / TESSERA_SAFETENSORS_WRITER not set: run via meson test");
    return;
  }
  TempDir dir;
  fs::path p = dir.path / "py.safetensors";
  std::string cmd = fmt::format("'{}' '{}' '{}'", python, script, p.string());
  REQUIRE(std::system(cmd.c_str()) == 0);

  nn::SafetensorsFile f(p);
  CHECK(f.metadata().at("writer") == "python-struct");
  CHECK(f.entries().size() == 9);
  std::vector<double> expect;
  for (int i = 0; i < 15; ++i) expect.push_back(i * 0.25 - 3.0);
  Tensor z = f.read("z.f32");
  CHECK(z.shape() == Shape{3, 5});
  CHECK(z.to_vector<double>() == expect);
  std::vector<double> recip;
  for (int i = 0; i < 7; ++i) recip.push_back(1.0 / (i + 1));
  CHECK(f.read("a.f64").to_vector<double>() == recip);
  // bf16 written by rounding to nearest even: the same as our conversion.
  CHECK(equal(
      f.read("m.bf16"),
      ops::to(from_vector<double>({-3.0, -2.75, -2.5, -2.25, -2.0, -1.75}, {2, 3}), DType::BF16)));
  auto h = f.read("m.f16", DType::F64).to_vector<double>();
  CHECK(h[0] == 0.5);
  CHECK(h[1] == -2.0);
  CHECK(h[2] == 65504.0);
  CHECK(std::abs(h[3] - 1e-3) < 1e-6);
  CHECK(f.read("i.i64").to_vector<int64_t>() ==
        std::vector<int64_t>{-(int64_t{1} << 40), 7, 0, int64_t{1} << 50});
  CHECK(f.read("i.i32").to_vector<int64_t>() == std::vector<int64_t>{-5, 0, 2147483647});
  CHECK(f.read("b.bool").to_vector<int64_t>() == std::vector<int64_t>{1, 0, 0, 1, 1});
  CHECK(f.read("e.empty").shape() == Shape{0, 4});
  Tensor s = f.read("s.scalar");
  CHECK(s.dim() == 0);
  CHECK(s.item() == 42.5);
}

TEST_CASE("a rejected safetensors file leaves no file open, thousands of times",
          "[safetensors][errors]") {
  TempDir dir;
  auto open_fds = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator{});
  };
  // One rejection per stage of the reader that runs after the file is opened:
  // the header length, the header text, the entries against the data.
  std::vector<fs::path> bad;
  auto add = [&](const std::string& name, const std::string& bytes) {
    bad.push_back(dir.path / name);
    write_bytes(bad.back(), bytes);
  };
  add("limit.safetensors", std::string(8, '\xff') + "{}");
  add("json.safetensors", file_bytes("{\"a\": ", ""));
  add("data.safetensors",
      file_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "1234"));
  auto before = open_fds();
  for (int i = 0; i < 3000; ++i)  // beyond the usual limit of 1024 descriptors
    for (const fs::path& p : bad) CHECK_THROWS(nn::SafetensorsFile(p));
  CHECK(open_fds() == before);
}

TEST_CASE("malformed safetensors files are rejected naming file and tensor",
          "[safetensors][errors]") {
  TempDir dir;
  auto parse = [](const std::string& header, uint64_t data_size) {
    return nn::SafetensorsFile::parse_header(header, data_size, "f.safetensors");
  };
  CHECK(parse(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8).size() == 1);
  CHECK_THROWS_WITH(parse(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", 8),
                    Contains("f.safetensors: the safetensors header is not valid JSON"));
  CHECK_THROWS_WITH(parse(R"([1, 2])", 8), Contains("must be a JSON object"));
  CHECK_THROWS_WITH(
      parse(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8),
      Contains("tensor 'a' has data_offsets [0, 16] outside the data section of 8 bytes"));
  CHECK_THROWS_WITH(parse(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 16),
                    Contains("tensor 'a' spans 8 bytes but F32 [3] needs 12"));
  CHECK_THROWS_WITH(parse(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 16),
                    Contains("outside the data section"));
  CHECK_THROWS_WITH(parse(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          16),
                    Contains("tensors 'a' and 'b' overlap"));
  CHECK_THROWS_WITH(
      parse(R"({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", 8),
      Contains("tensor 'a' has unsupported dtype 'F8_E4M3'"));
  CHECK_THROWS_WITH(parse(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8),
                    Contains("negative or non-integer dim"));
  CHECK_THROWS_WITH(
      parse(
          R"({"a": {"dtype": "F32", "shape": [281474976710656, 281474976710656], "data_offsets": [0, 8]}})",
          8),
      Contains("too large"));
  CHECK_THROWS_WITH(parse(R"({"a": {"dtype": "F32", "shape": [2]}})", 8),
                    Contains("needs dtype, shape and data_offsets"));
  CHECK_THROWS_WITH(parse(R"({"__metadata__": {"k": 1}})", 0),
                    Contains("__metadata__ value 'k' is not a string"));

  // File-level: truncated, absurd header length, data cut short.
  fs::path p = dir.path / "bad.safetensors";
  write_bytes(p, "abc");
  CHECK_THROWS_WITH(nn::SafetensorsFile(p), Contains("truncated safetensors file (3 bytes"));
  write_bytes(
      p, file_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "12345678")
             .substr(0, 30));
  CHECK_THROWS_WITH(nn::SafetensorsFile(p), Contains("runs past the end"));
  write_bytes(
      p, file_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "1234"));
  CHECK_THROWS_WITH(nn::SafetensorsFile(p), Contains("bad.safetensors: tensor 'a' has data_offsets "
                                                     "[0, 8] outside the data section of 4 bytes"));
  std::string huge(8, '\xff');
  write_bytes(p, huge + "{}");
  CHECK_THROWS_WITH(nn::SafetensorsFile(p), Contains("exceeds the limit"));
  write_bytes(p, file_bytes(std::string(64, ' '), ""));
  CHECK_THROWS_WITH(nn::SafetensorsFile(p, 16),
                    Contains("header of 64 bytes exceeds the limit of 16"));
  CHECK_THROWS_WITH(nn::SafetensorsFile(dir.path / "missing.safetensors"),
                    Contains("missing.safetensors: cannot read"));

  // The writer refuses entries that are not back to back, and leaves no partial file.
  fs::path w = dir.path / "w.safetensors";
  std::vector<nn::SafetensorsEntry> gap{{"a", DType::F32, {2}, 0, 8},
                                        {"b", DType::F32, {2}, 16, 24}};
  CHECK_THROWS_WITH(nn::write_safetensors(w, gap, [](size_t) { return zeros({2}); }),
                    Contains("back to back"));
  std::vector<nn::SafetensorsEntry> wrong{{"a", DType::F32, {2}, 0, 8}};
  CHECK_THROWS_WITH(nn::write_safetensors(w, wrong, [](size_t) { return zeros({3}); }),
                    Contains("tensor 'a' is f32 [3], the header says f32 [2]"));
  CHECK(!fs::exists(w));
  CHECK(!fs::exists(w.string() + ".tmp"));
}
