// The test binaries' main() (tests/test_main.cc) turns on Abseil's
// lock-order check, so every test that runs the server's threads also checks
// that no two absl::Mutexes are ever taken in both orders. This shows the
// check is on: a program that takes two mutexes in one order, then in the
// other, dies on the second order, though it never deadlocked (one thread).
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"

namespace knapserve {
namespace {

TEST(LockOrderCheckTest, TakingTwoMutexesInBothOrdersAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        absl::Mutex first;
        absl::Mutex second;
        {
          absl::MutexLock a(&first);
          absl::MutexLock b(&second);
        }
        absl::MutexLock b(&second);
        absl::MutexLock a(&first);
      },
      "deadlock");
}

TEST(LockOrderCheckTest, OneOrderIsFine) {
  absl::Mutex first;
  absl::Mutex second;
  for (int i = 0; i < 3; ++i) {
    absl::MutexLock a(&first);
    absl::MutexLock b(&second);
  }
  SUCCEED();
}

}  // namespace
}  // namespace knapserve
