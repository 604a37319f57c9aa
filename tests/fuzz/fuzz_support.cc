#include "tests/fuzz/fuzz_support.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "google/protobuf/stubs/logging.h"
#include "tools/shared_data.h"

namespace knapserve::fuzz {

void Fail(const char* file, int line, const char* condition,
          std::string_view message) {
  std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s %.*s\n", file, line,
               condition, static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

void CheckRefusal(const absl::Status& status) {
  FUZZ_CHECK(!status.ok());
  FUZZ_CHECK_MSG(!status.message().empty(), status.ToString());
}

namespace {

// The scratch files this process named; removed when it exits normally
// (libFuzzer's -runs=N and the replay driver end with exit()). A crash leaves
// them, beside the crash's own artifact.
std::vector<std::string>& ScratchFiles() {
  static auto* files = new std::vector<std::string>();
  return *files;
}

void RemoveScratchFiles() {
  for (const std::string& path : ScratchFiles()) std::remove(path.c_str());
}

}  // namespace

std::string ScratchPath(std::string_view name) {
  const char* tmp = std::getenv("TMPDIR");
  std::string path = absl::StrCat(
      tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/knapserve-fuzz-",
      static_cast<int64_t>(getpid()), "-", std::string(name));
  if (ScratchFiles().empty()) std::atexit(RemoveScratchFiles);
  ScratchFiles().push_back(path);
  return path;
}

void WriteScratchFile(const std::string& path, const uint8_t* data,
                      size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data),
            static_cast<std::streamsize>(size));
  out.close();
  FUZZ_CHECK_MSG(out.good(), path);
}

std::string SharedFile(std::string_view relative) {
  return SharedPath(std::string(relative));
}

namespace {

template <typename T>
T LoadOrExit(absl::StatusOr<T> loaded) {
  if (!loaded.ok()) {
    std::fprintf(stderr,
                 "fuzz: cannot load the shared data (set KNAPSERVE_SHARED): "
                 "%s\n",
                 loaded.status().ToString().c_str());
    std::exit(2);
  }
  return std::move(*loaded);
}

}  // namespace

const LlamaModel& Stories260k() {
  static const LlamaModel* model =
      LoadOrExit(
          LlamaModel::Load(SharedFile("models/stories260k"), ModelOptions{}))
          .release();
  return *model;
}

const Tokenizer& SharedTokenizer(std::string_view relative) {
  static auto* loaded =
      new std::map<std::string, std::unique_ptr<Tokenizer>, std::less<>>();
  auto it = loaded->find(relative);
  if (it == loaded->end()) {
    it = loaded
             ->emplace(std::string(relative),
                       LoadOrExit(Tokenizer::FromFile(SharedFile(relative))))
             .first;
  }
  return *it->second;
}

const Tokenizer& Stories260kTokenizer() {
  return SharedTokenizer("models/stories260k/tokenizer.json");
}

void SilenceProtobufLogs() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

void UseOneTorchThread() { at::set_num_threads(1); }

}  // namespace knapserve::fuzz
