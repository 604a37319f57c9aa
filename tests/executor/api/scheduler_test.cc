// Tests of the Scheduler (executor/api/scheduler.h): admission limits, a job
// that throws does not take its worker.
#include "executor/api/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace knapserve {
namespace {

TEST(SchedulerTest, RefusesBeyondTheLimitAndWhileDraining) {
  Scheduler scheduler(SchedulerOptions{/*max_running=*/1, /*max_queue=*/1});
  absl::Notification release;
  absl::Notification started;
  ASSERT_TRUE(scheduler
                  .Submit([&] {
                    started.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();
  EXPECT_TRUE(scheduler.Submit([] {}).ok());  // queued
  EXPECT_EQ(scheduler.Submit([] {}).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(scheduler.running(), 1);
  EXPECT_EQ(scheduler.queued(), 1);
  release.Notify();
  EXPECT_TRUE(scheduler.Drain(std::chrono::seconds(30)));
  EXPECT_TRUE(scheduler.draining());
  EXPECT_EQ(scheduler.Submit([] {}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(scheduler.running(), 0);
}

TEST(SchedulerTest, AJobThatThrowsDoesNotTakeItsWorker) {
  Scheduler scheduler(SchedulerOptions{/*max_running=*/1, /*max_queue=*/4});
  ASSERT_TRUE(
      scheduler.Submit([] { throw std::runtime_error("a bug in a job"); })
          .ok());
  std::atomic<bool> ran{false};
  ASSERT_TRUE(scheduler.Submit([&] { ran = true; }).ok());
  EXPECT_TRUE(scheduler.Drain(std::chrono::seconds(30)));
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(scheduler.running(), 0);
}

}  // namespace
}  // namespace knapserve
