#include "tests/testing/temp_dir.h"

#include <stdlib.h>

#include <filesystem>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace knapserve::testing {
namespace {

ABSL_CONST_INIT absl::Mutex mu(absl::kConstInit);
// The folders MakeTempDir made and TempDirEnvironment has not removed yet.
std::vector<std::string>& BinaryLifetimeDirs()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  static auto* dirs = new std::vector<std::string>();
  return *dirs;
}

// mkdtemp under temp_directory_path() ($TMPDIR, else /tmp).
std::string CreateTempDir(const std::string& prefix) {
  std::error_code error;
  const std::filesystem::path base =
      std::filesystem::temp_directory_path(error);
  if (error) {
    ADD_FAILURE() << "no temporary folder: " << error.message();
    return "";
  }
  std::string pattern = (base / ("knapserve_" + prefix + "_XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp failed for " << pattern;
    return "";
  }
  return pattern;
}

void RemoveTree(const std::string& path) {
  if (path.empty()) return;
  std::error_code error;
  std::filesystem::remove_all(path, error);
  if (error)
    ADD_FAILURE() << "cannot remove " << path << ": " << error.message();
}

}  // namespace

ScopedTempDir::ScopedTempDir(const std::string& prefix)
    : path_(CreateTempDir(prefix)) {}

ScopedTempDir::~ScopedTempDir() { RemoveTree(path_); }

std::string MakeTempDir(const std::string& prefix) {
  std::string path = CreateTempDir(prefix);
  if (path.empty()) return path;
  absl::MutexLock lock(&mu);
  BinaryLifetimeDirs().push_back(path);
  return path;
}

void TempDirEnvironment::TearDown() {
  std::vector<std::string> dirs;
  {
    absl::MutexLock lock(&mu);
    dirs.swap(BinaryLifetimeDirs());
  }
  for (const std::string& dir : dirs) RemoveTree(dir);
}

}  // namespace knapserve::testing
