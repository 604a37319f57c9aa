#include "tests/testing/test_util.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "common/model/llama.h"
#include "common/text/tokenizer.h"

namespace knapserve::testing {

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  EXPECT_TRUE(out.good()) << "cannot write " << path;
}

std::unique_ptr<LlamaModel> LoadModelOrFail(const std::string& dir,
                                            c10::ScalarType dtype) {
  ModelOptions options;
  options.dtype = dtype;
  auto model = LlamaModel::Load(dir, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

std::unique_ptr<Tokenizer> LoadTokenizerOrFail(const std::string& path) {
  auto tokenizer = Tokenizer::FromFile(path);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

ScopedThreadCount::ScopedThreadCount(int n) : saved_(at::get_num_threads()) {
  at::set_num_threads(n);
}

ScopedThreadCount::~ScopedThreadCount() { at::set_num_threads(saved_); }

}  // namespace knapserve::testing
