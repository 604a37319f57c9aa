// Shared main() for the knapserve test binaries: one torch thread per test
// process (ctest runs one process per core; several OpenMP teams spinning on
// the same cores slowed the suite down by 50x), the test environment
// (../shared beside the checkout, a temporary profile cache:
// tests/testing/test_models.h), then GoogleTest, with the environment that
// removes the MakeTempDir folders after the last test (temp_dir.h).
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  knapserve::testing::SetUpTestEnvironment();
  ::testing::AddGlobalTestEnvironment(
      new knapserve::testing::TempDirEnvironment());
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
