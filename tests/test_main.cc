// Shared main() for the knapserve test binaries: sets torch to the machine's
// two cores (torch starts with one thread here) and runs GoogleTest.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(2);
  return RUN_ALL_TESTS();
}
