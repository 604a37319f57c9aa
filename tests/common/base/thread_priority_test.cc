// ThreadPriority: parsing, names, validation, and that ApplyToThisThread
// changes the calling thread's policy or nice value (read back from /proc)
// and no other thread's.
#include "common/base/thread_priority.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <thread>

#include "tests/testing/thread_sched.h"

namespace knapserve {
namespace {

using testing::ReadThreadSched;
using testing::ThreadSched;

TEST(ThreadPriorityTest, ParsesNamesAndNiceValuesAndRefusesTheRest) {
  EXPECT_EQ(*ParseThreadPriority("idle"), ThreadPriority::Idle());
  EXPECT_EQ(*ParseThreadPriority("normal"), ThreadPriority::Nice(0));
  EXPECT_EQ(*ParseThreadPriority("19"), ThreadPriority::Nice(19));
  for (const char* bad : {"", "20", "-1", "auto", "IDLE", "5x"}) {
    EXPECT_EQ(ParseThreadPriority(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(ThreadPriorityName(ThreadPriority::Idle()), "idle");
  EXPECT_EQ(ThreadPriorityName(ThreadPriority::Nice(7)), "nice 7");
  EXPECT_EQ(ValidateThreadPriority(ThreadPriority::Nice(20), "planner").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateThreadPriority(ThreadPriority::Nice(-1), "planner").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateThreadPriority(ThreadPriority::Idle(), "planner").ok());
}

TEST(ThreadPriorityTest, AppliesToTheCallingThreadOnly) {
  ThreadSched seen_nice, seen_idle;
  const ThreadSched before = ReadThreadSched("/proc/thread-self/stat");
  std::thread([&] {
    ASSERT_TRUE(ApplyToThisThread(ThreadPriority::Nice(7)).ok());
    seen_nice = ReadThreadSched("/proc/thread-self/stat");
  }).join();
  std::thread([&] {
    ASSERT_TRUE(ApplyToThisThread(ThreadPriority::Idle()).ok());
    seen_idle = ReadThreadSched("/proc/thread-self/stat");
  }).join();
  EXPECT_EQ(seen_nice.nice, 7);
  EXPECT_EQ(seen_nice.policy, SCHED_OTHER);
  EXPECT_EQ(seen_idle.policy, SCHED_IDLE);
  const ThreadSched after = ReadThreadSched("/proc/thread-self/stat");
  EXPECT_EQ(after.nice, before.nice) << "the test's own thread is unchanged";
  EXPECT_EQ(after.policy, before.policy);
}

}  // namespace
}  // namespace knapserve
