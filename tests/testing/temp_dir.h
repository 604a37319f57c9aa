// Temporary folders for the tests, all under $TMPDIR (/tmp when unset), all
// removed again:
//
//   ScopedTempDir dir("model_config");        // one test's folder
//   WriteFile(dir.path() + "/config.json", ...);
//   // ~ScopedTempDir removes the folder and everything in it.
//
//   static const std::string* dir = new std::string(MakeTempDir("deep_tiny"));
//   // A folder for a fixture that lives as long as the test binary (a model
//   // written once and shared by many tests): removed when the tests end, by
//   // the TempDirEnvironment that tests/test_main.cc registers.
//
// A failure to create a folder fails the current test (ADD_FAILURE) and gives
// the path "". MakeTempDir and TempDirEnvironment may be used from any
// thread; a ScopedTempDir belongs to the thread that uses it.
#ifndef KNAPSERVE_TESTS_TESTING_TEMP_DIR_H_
#define KNAPSERVE_TESTS_TESTING_TEMP_DIR_H_

#include <gtest/gtest.h>

#include <string>

namespace knapserve::testing {

// A fresh, empty folder $TMPDIR/knapserve_<prefix>_XXXXXX that the object
// owns: the destructor removes it with everything in it.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& prefix = "test");
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A fresh, empty folder $TMPDIR/knapserve_<prefix>_XXXXXX that stays until the
// test program ends (removed by TempDirEnvironment::TearDown).
std::string MakeTempDir(const std::string& prefix);

// Removes every folder MakeTempDir made, after the last test. Registered once
// per test binary, in tests/test_main.cc.
class TempDirEnvironment : public ::testing::Environment {
 public:
  void TearDown() override;
};

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_TEMP_DIR_H_
