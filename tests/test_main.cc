// Shared main() for the knapserve test binaries: one torch thread per test
// process (ctest runs one process per core; several OpenMP teams spinning on
// the same cores slowed the suite down by 50x), the test environment
// (../shared beside the checkout; a temporary profile cache once the tests
// start: tests/testing/test_models.h), the SIMD target (KNAPSERVE_SIMD, or
// KNAPSERVE_SIMD_TEST in tests/CMakeLists.txt's per-target runs, which are
// skipped where this CPU cannot run their target or it is the CPU's best), then
// GoogleTest, with the environment that removes the MakeTempDir folders after
// the last test (temp_dir.h). CTest runs one process per suite
// (tests/testing/gtest_suites.cmake), which reads the "every test skipped"
// line printed at the end. Abseil's lock-order checking is on: a test that
// takes two absl::Mutexes in an order that, with an order seen before, could
// deadlock aborts with both acquisition stacks, whether or not that run
// deadlocked.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/model/simd_target.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
  ::testing::InitGoogleTest(&argc, argv);
  knapserve::testing::SetUpTestEnvironment();
  ::testing::AddGlobalTestEnvironment(
      new knapserve::testing::ProfileCacheEnvironment());
  ::testing::AddGlobalTestEnvironment(
      new knapserve::testing::TempDirEnvironment());
  // A per-target run (tests/CMakeLists.txt) names its target in
  // KNAPSERVE_SIMD_TEST; it becomes KNAPSERVE_SIMD, for this process and the
  // programs it starts.
  const char* test_target = std::getenv("KNAPSERVE_SIMD_TEST");
  const bool per_target_run = test_target != nullptr;
  if (per_target_run) setenv("KNAPSERVE_SIMD", test_target, 1);
  const absl::Status simd = knapserve::simd::EnsureChosen();
  if (!simd.ok()) {
    if (!per_target_run ||
        simd.code() != absl::StatusCode::kFailedPrecondition) {
      std::fprintf(stderr, "%s\n", simd.ToString().c_str());
      return 1;
    }
    // tests/CMakeLists.txt counts this line as a skipped test.
    std::printf("knapserve tests: SIMD run skipped: %s\n",
                std::string(simd.message()).c_str());
    return 0;
  }
  if (per_target_run && knapserve::simd::CurrentTarget() ==
                            knapserve::simd::SupportedTargets().front()) {
    std::printf(
        "knapserve tests: SIMD run skipped: target %s is this CPU's best: "
        "the runs without KNAPSERVE_SIMD cover it\n",
        knapserve::simd::CurrentTarget().c_str());
    return 0;
  }
  std::fprintf(stderr, "knapserve tests: %s\n",
               knapserve::simd::Describe().c_str());
  at::set_num_threads(1);
  const int result = RUN_ALL_TESTS();
  // tests/testing/gtest_suites.cmake reports a suite whose every test
  // skipped as skipped by this line (never printed when a test passed or
  // failed).
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (unit.skipped_test_count() > 0 && unit.successful_test_count() == 0 &&
      unit.failed_test_count() == 0) {
    std::printf("knapserve tests: every test skipped (%d)\n",
                unit.skipped_test_count());
  }
  return result;
}
