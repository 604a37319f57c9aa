#include "common/checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using testing::Message;
using testing::ReadFile;
using testing::WriteFile;

// A safetensors file from raw header text and `data_bytes` zero bytes of data.
std::string RawFile(const std::string& header, size_t data_bytes) {
  uint64_t size = header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &size, 8);
  return bytes + header + std::string(data_bytes, '\0');
}

class SafetensorsBadFileTest : public ::testing::Test {
 protected:
  // Writes `bytes` to a file and returns the Open() status, which must fail.
  absl::Status OpenBytes(const std::string& bytes) {
    path_ = temp_.path() + "/bad.safetensors";
    WriteFile(path_, bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::Open(path_);
    EXPECT_FALSE(file.ok());
    if (file.ok()) return absl::OkStatus();
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
        << file.status();
    EXPECT_THAT(Message(file.status()), HasSubstr(path_));
    return file.status();
  }
  absl::Status OpenHeader(const std::string& header, size_t data_bytes) {
    return OpenBytes(RawFile(header, data_bytes));
  }

  const testing::ScopedTempDir temp_{"safetensors"};
  std::string path_;
};

TEST(SafetensorsTest, RoundTripsEveryDtypeWithValues) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string path = temp.path() + "/model.safetensors";
  torch::manual_seed(1);
  const torch::Tensor f32 = torch::randn({3, 5});
  const torch::Tensor bf16 = torch::randn({4, 2}).to(torch::kBFloat16);
  const torch::Tensor f16 = torch::randn({7}).to(torch::kFloat16);
  const torch::Tensor scalar = torch::full({}, 2.5f);
  const torch::Tensor empty = torch::zeros({0, 3});
  // Non-contiguous input is written contiguously.
  const torch::Tensor transposed = torch::randn({2, 3}).t();
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"a.f32", f32},
                                {"b.bf16", bf16},
                                {"c.f16", f16},
                                {"d.scalar", scalar},
                                {"e.empty", empty},
                                {"f.transposed", transposed}},
                               {{"format", "pt"}, {"note", "hello"}})
                  .ok());
  ASSERT_FALSE(std::filesystem::exists(path + ".tmp"));

  // The header is padded so the data section starts 8-byte aligned.
  const std::string bytes = ReadFile(path);
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  ASSERT_EQ((*file)->tensors().size(), 6u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->metadata().at("note"), "hello");

  const TensorInfo* info = (*file)->Find("b.bf16");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->dtype, "BF16");
  EXPECT_EQ(info->shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(info->end - info->begin, 16u);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
  EXPECT_EQ((*file)->Find("a.f32")->dtype, "F32");
  EXPECT_EQ((*file)->Find("c.f16")->dtype, "F16");

  for (const auto& [name, expected] :
       std::vector<std::pair<std::string, torch::Tensor>>{
           {"a.f32", f32},
           {"b.bf16", bf16},
           {"c.f16", f16},
           {"d.scalar", scalar},
           {"e.empty", empty},
           {"f.transposed", transposed}}) {
    auto view = (*file)->View(name);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->scalar_type(), expected.scalar_type()) << name;
    EXPECT_EQ(view->sizes(), expected.sizes()) << name;
    EXPECT_TRUE(torch::equal(*view, expected)) << name;
  }
  auto missing = (*file)->View("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(missing.status()),
              AllOf(HasSubstr("nope"), HasSubstr(path)));
}

TEST(SafetensorsTest, ViewsAliasTheMapping) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string path = temp.path() + "/model.safetensors";
  ASSERT_TRUE(
      WriteSafetensors(path, {{"x", torch::arange(16, torch::kFloat32)}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto a = (*file)->View("x");
  auto b = (*file)->View("x");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->data_ptr(), b->data_ptr());
  EXPECT_EQ(a->device(), torch::kCPU);
}

TEST(SafetensorsTest, ZeroTensorsIsValid) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string& dir = temp.path();
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {}).ok());
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
  EXPECT_TRUE((*file)->metadata().empty());
  // "{}" with no data, written by hand, too.
  WriteFile(dir + "/raw.safetensors", RawFile("{}", 0));
  EXPECT_TRUE(SafetensorsFile::Open(dir + "/raw.safetensors").ok());
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_TRUE((*checkpoint)->TensorNames().empty());
}

TEST(SafetensorsTest, WriteRejectsUnsupportedDtypes) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string path = temp.path() + "/model.safetensors";
  absl::Status status =
      WriteSafetensors(path, {{"ints", torch::zeros({2}, torch::kInt64)}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status),
              AllOf(HasSubstr("ints"), HasSubstr("unsupported")));
  status = WriteSafetensors(
      path, {{"x", torch::zeros({2})}, {"x", torch::zeros({2})}});
  EXPECT_THAT(Message(status), HasSubstr("duplicate"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SafetensorsTest, StreamingWriteChecksEachTensorAgainstItsSpec) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string path = temp.path() + "/model.safetensors";
  absl::Status status =
      WriteSafetensorsStreaming(path, {{"w", "F32", {2, 2}}},
                                [](size_t) -> absl::StatusOr<torch::Tensor> {
                                  return torch::zeros({3});
                                });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status),
              AllOf(HasSubstr("'w'"), HasSubstr("[3]"), HasSubstr("[2, 2]")));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  ASSERT_TRUE(WriteSafetensorsStreaming(
                  path, {{"w", "BF16", {2, 2}}, {"v", "F32", {3}}},
                  [](size_t i) -> absl::StatusOr<torch::Tensor> {
                    return i == 0 ? torch::ones({2, 2}, torch::kBFloat16)
                                  : torch::ones({3});
                  })
                  .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->tensors()[0].name, "w");
  EXPECT_EQ((*file)->tensors()[1].name, "v");
}

// ---------------------------------------------------------------------------
// Bad files: every problem gets an InvalidArgument naming the file.

TEST_F(SafetensorsBadFileTest, ShorterThanEightBytes) {
  EXPECT_THAT(Message(OpenBytes("abc")),
              HasSubstr("shorter than the 8-byte header length"));
  EXPECT_THAT(Message(OpenBytes("")), HasSubstr("0 bytes"));
}

TEST_F(SafetensorsBadFileTest, HeaderLengthPastEndOfFile) {
  std::string bytes = RawFile("{}", 0);
  uint64_t huge = 1000;
  std::memcpy(bytes.data(), &huge, 8);
  EXPECT_THAT(Message(OpenBytes(bytes)),
              HasSubstr("header length 1000 runs past the end"));
  huge = ~0ull;
  std::memcpy(bytes.data(), &huge, 8);
  EXPECT_THAT(Message(OpenBytes(bytes)), HasSubstr("runs past the end"));
}

TEST_F(SafetensorsBadFileTest, HeaderNotJson) {
  EXPECT_THAT(Message(OpenHeader("{\"a\": ", 0)),
              HasSubstr("header is not valid JSON"));
  EXPECT_THAT(Message(OpenHeader("\xff\xfe garbage", 0)),
              HasSubstr("not valid JSON"));
}

TEST_F(SafetensorsBadFileTest, HeaderNotAnObject) {
  EXPECT_THAT(Message(OpenHeader("[1, 2]", 0)),
              HasSubstr("header is not a JSON object"));
  EXPECT_THAT(Message(OpenHeader("42", 0)),
              HasSubstr("header is not a JSON object"));
}

TEST_F(SafetensorsBadFileTest, EntryMissingFields) {
  EXPECT_THAT(Message(OpenHeader(
                  R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8)),
              AllOf(HasSubstr("'w'"), HasSubstr("missing 'dtype'")));
  EXPECT_THAT(Message(OpenHeader(
                  R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", 8)),
              AllOf(HasSubstr("'w'"), HasSubstr("missing 'shape'")));
  EXPECT_THAT(
      Message(OpenHeader(R"({"w": {"dtype": "F32", "shape": [2]}})", 8)),
      AllOf(HasSubstr("'w'"), HasSubstr("missing 'data_offsets'")));
  EXPECT_THAT(Message(OpenHeader(R"({"w": 3})", 8)),
              HasSubstr("not a JSON object"));
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8)),
      HasSubstr("'data_offsets' must be two non-negative integers"));
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})",
          8)),
      HasSubstr("'data_offsets' must be two non-negative integers"));
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}})",
          8)),
      HasSubstr("non-integer"));
  EXPECT_THAT(Message(OpenHeader(R"({"__metadata__": [1]})", 0)),
              HasSubstr("'__metadata__' is not a JSON object"));
  EXPECT_THAT(Message(OpenHeader(R"({"__metadata__": {"a": 1}})", 0)),
              HasSubstr("is not a string"));
}

TEST_F(SafetensorsBadFileTest, UnsupportedDtypes) {
  for (const std::string dtype :
       {"I8", "F64", "BOOL", "U8", "I64", "F8_E4M3"}) {
    const std::string header = R"({"w": {"dtype": ")" + dtype +
                               R"(", "shape": [2], "data_offsets": [0, 2]}})";
    EXPECT_THAT(Message(OpenHeader(header, 16)),
                AllOf(HasSubstr("unsupported dtype '" + dtype + "'"),
                      HasSubstr("'w'")));
  }
}

TEST_F(SafetensorsBadFileTest, NegativeDimension) {
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})",
          8)),
      AllOf(HasSubstr("'w'"), HasSubstr("negative dimension")));
}

TEST_F(SafetensorsBadFileTest, OffsetsDoNotMatchShape) {
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}})",
          24)),
      AllOf(HasSubstr("'w'"), HasSubstr("span 12 bytes"),
            HasSubstr("needs 24 bytes")));
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 0]}})",
          8)),
      HasSubstr("end before they begin"));
  // Element count overflowing 64 bits.
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})",
          8)),
      HasSubstr("more than 2^64"));
}

TEST_F(SafetensorsBadFileTest, OffsetsOutOfDataSection) {
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
          16)),
      AllOf(HasSubstr("'w'"), HasSubstr("out of the data section (16 bytes)")));
}

TEST_F(SafetensorsBadFileTest, OverlappingTensors) {
  EXPECT_THAT(
      Message(OpenHeader(
          R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
          16)),
      AllOf(HasSubstr("'a'"), HasSubstr("'b'"), HasSubstr("overlap")));
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string path = temp.path() + "/absent.safetensors";
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(file.status()), HasSubstr(path));
}

// ---------------------------------------------------------------------------
// The real stories260k checkpoint.

TEST(CheckpointTest, OpensStories260k) {
  const std::string dir = testing::Stories260kDir();
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const std::vector<std::string> names = (*checkpoint)->TensorNames();
  EXPECT_EQ(names.size(), 47u);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_TRUE((*checkpoint)->Has("model.embed_tokens.weight"));
  EXPECT_FALSE((*checkpoint)->Has("lm_head.weight"));

  auto embed = (*checkpoint)->Get("model.embed_tokens.weight", {512, 64});
  ASSERT_TRUE(embed.ok()) << embed.status();
  EXPECT_EQ(embed->scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::isfinite(*embed).all().item<bool>());
  EXPECT_GT(embed->abs().sum().item<float>(), 0);
  auto q =
      (*checkpoint)->Get("model.layers.4.self_attn.k_proj.weight", {32, 64});
  ASSERT_TRUE(q.ok()) << q.status();

  auto view = (*checkpoint)->View("model.layers.0.mlp.gate_proj.weight");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->sizes(), (std::vector<int64_t>{172, 64}));
  const TensorInfo* info =
      (*checkpoint)->Find("model.layers.0.mlp.down_proj.weight");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->shape, (std::vector<int64_t>{64, 172}));
  EXPECT_EQ(info->dtype, "F32");
  EXPECT_EQ((*checkpoint)->Find("lm_head.weight"), nullptr);
  auto absent = (*checkpoint)->View("lm_head.weight");
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(absent.status()),
              AllOf(HasSubstr("lm_head.weight"), HasSubstr(dir)));

  auto wrong = (*checkpoint)->Get("model.norm.weight", {32});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      Message(wrong.status()),
      AllOf(HasSubstr("model.safetensors"), HasSubstr("model.norm.weight"),
            HasSubstr("has shape [64]"), HasSubstr("expected [32]")));
  auto missing = (*checkpoint)->Get("lm_head.weight", {512, 64});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(missing.status()),
              AllOf(HasSubstr("lm_head.weight"), HasSubstr(dir)));

  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->tensors().size(), 47u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
}

TEST(CheckpointTest, ConcurrentGetsAreSafe) {
  auto checkpoint = Checkpoint::Open(testing::Stories260kDir());
  ASSERT_TRUE(checkpoint.ok());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        if (!(*checkpoint)->Get("model.norm.weight", {64}).ok()) ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(CheckpointTest, EmptyOrMissingFolder) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string& dir = temp.path();
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr(dir), HasSubstr("no model.safetensors")));
  checkpoint = Checkpoint::Open(dir + "/nope");
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(checkpoint.status()), HasSubstr("does not exist"));
}

TEST(CheckpointTest, BadSingleFileIsReported) {
  const testing::ScopedTempDir temp("safetensors");
  const std::string& dir = temp.path();
  WriteFile(dir + "/model.safetensors", "xyz");
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(checkpoint.status()),
              HasSubstr(dir + "/model.safetensors"));
}

// ---------------------------------------------------------------------------
// Sharded checkpoints.

class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_.path();
    a_ = torch::randn({4, 3});
    b_ = torch::randn({5}).to(torch::kBFloat16);
    c_ = torch::randn({2, 2}).to(torch::kFloat16);
    ASSERT_TRUE(WriteSafetensors(dir_ + "/model-00001-of-00002.safetensors",
                                 {{"a", a_}, {"b", b_}})
                    .ok());
    ASSERT_TRUE(WriteSafetensors(dir_ + "/model-00002-of-00002.safetensors",
                                 {{"c", c_}})
                    .ok());
  }

  void WriteIndex(const std::string& text) {
    WriteFile(dir_ + "/model.safetensors.index.json", text);
  }
  std::string IndexPath() const {
    return dir_ + "/model.safetensors.index.json";
  }

  const testing::ScopedTempDir temp_{"safetensors"};
  std::string dir_;
  torch::Tensor a_, b_, c_;
};

TEST_F(ShardedCheckpointTest, RoundTrip) {
  WriteIndex(R"({"metadata": {"total_size": 42}, "weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors"}})");
  // A single-file model.safetensors beside the index is ignored.
  ASSERT_TRUE(
      WriteSafetensors(dir_ + "/model.safetensors", {{"z", torch::zeros({1})}})
          .ok());
  auto checkpoint = Checkpoint::Open(dir_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->TensorNames(),
            (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_FALSE((*checkpoint)->Has("z"));
  auto a = (*checkpoint)->Get("a", {4, 3});
  auto b = (*checkpoint)->Get("b", {5});
  auto c = (*checkpoint)->Get("c", {2, 2});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE(torch::equal(*a, a_));
  EXPECT_TRUE(torch::equal(*b, b_));
  EXPECT_TRUE(torch::equal(*c, c_));
  auto wrong = (*checkpoint)->Get("c", {4});
  EXPECT_THAT(Message(wrong.status()),
              HasSubstr("model-00002-of-00002.safetensors"));
}

TEST_F(ShardedCheckpointTest, MalformedIndex) {
  WriteIndex("{\"weight_map\": ");
  auto checkpoint = Checkpoint::Open(dir_);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr(IndexPath()), HasSubstr("not valid JSON")));

  WriteIndex(R"({"metadata": {}})");
  checkpoint = Checkpoint::Open(dir_);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr(IndexPath()), HasSubstr("missing 'weight_map'")));

  WriteIndex(R"({"weight_map": {"a": 7}})");
  checkpoint = Checkpoint::Open(dir_);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr(IndexPath()), HasSubstr("'a'")));

  WriteIndex(R"({"weight_map": {"a": "../model-00001-of-00002.safetensors"}})");
  checkpoint = Checkpoint::Open(dir_);
  EXPECT_THAT(Message(checkpoint.status()), HasSubstr("not a plain file name"));
}

TEST_F(ShardedCheckpointTest, MissingShard) {
  WriteIndex(R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                "c": "model-00003-of-00003.safetensors"}})");
  auto checkpoint = Checkpoint::Open(dir_);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr(IndexPath()),
                    HasSubstr("model-00003-of-00003.safetensors"),
                    HasSubstr("'c'"), HasSubstr("does not exist")));
}

TEST_F(ShardedCheckpointTest, TensorNotInItsShard) {
  WriteIndex(R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                "c": "model-00001-of-00002.safetensors"}})");
  auto checkpoint = Checkpoint::Open(dir_);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr(IndexPath()), HasSubstr("'c'"),
                    HasSubstr("model-00001-of-00002.safetensors"),
                    HasSubstr("no such tensor")));
}

TEST_F(ShardedCheckpointTest, CorruptShard) {
  WriteFile(dir_ + "/model-00002-of-00002.safetensors", RawFile("[]", 0));
  WriteIndex(R"({"weight_map": {"c": "model-00002-of-00002.safetensors"}})");
  auto checkpoint = Checkpoint::Open(dir_);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(checkpoint.status()),
              AllOf(HasSubstr("model-00002-of-00002.safetensors"),
                    HasSubstr("not a JSON object")));
}

}  // namespace
}  // namespace knapserve
